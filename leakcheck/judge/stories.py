"""The whole story of each rule: what it finds, why, and every fix (``leakcheck explain RULE``).

A finding is one line and its fix one (NOTE [one line per finding] in verdict.py); what does
not fit there, the causes a rule tells apart and the fixes beside the first, is told here,
once per rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["STORIES", "headline"]

_TEXT = """\
survivor (leak): a process the work started outlives its epoch.

A process started during an epoch is still alive more than the grace after that epoch ended
(grace: 2 s; 1 s under pytest).

Judged: non-persistent loader workers, and whatever the work started (descendants), in the
epoch their create time falls in, however late leakcheck found them. A process last seen
within the grace and found gone after it may have exited in time, and is not judged.

Causes and fixes:
- a loader's workers outlive the epoch: its iterator is still referenced. End each epoch's
  iterator (exhaust it, or `del` it: its shutdown stops the workers), keep no reference to it
  past the epoch, or set persistent_workers=True if one set of workers should live on.
- a reference cycle keeps the iterator (and its persistent workers) alive; under pytest the
  finding says "freed only by gc.collect()". Break the cycle (an exception or traceback kept
  in a variable or attribute, an object that refers back to itself through a callback or a
  bound method), or `del` the iterator and call gc.collect() where the work ends. A worker's
  error that the loader re-raised and the work caught (`pytest.raises`) is such a cycle (the
  re-raise's frame holds it): call gc.collect() after catching it.
- a loader worker started it and it outlives its epoch (an orphan once the worker exits):
  stop it within the epoch in the code that starts it (join or terminate it), or start it
  outside the workers; leakcheck.worker_init_fn(terminate_children=True) stops it when its
  worker exits, at the epoch's end unless the workers are persistent.
- a subprocess or pool the work started: join or terminate it (`with Pool(...)`,
  proc.join(), proc.terminate()) before the epoch or test that started it ends.
- under pytest, a fixture started it: stop it in the fixture's finalizer (after its `yield`,
  or request.addfinalizer), or give the fixture a narrower scope.

orphan (leak): a process of the job outlived its parent, and nobody will reap it.

A process of the job was reparented away (its parent exited) and is still alive. Worst when
it holds GPU memory or /dev/nvidia* descriptors: its CUDA context stays until it dies.

The finding names the epoch it left the job's tree in ("since epoch 0"), or the first in
which a scan found it outside ("by epoch 2"), and whether it is still alive after the job.
Runtime helpers that daemonize by design (torch_shm_manager) are no orphans; another helper
(a forkserver, a resource tracker) is judged once seen alive past the grace.

Fixes:
- make workers wait for or terminate their children before exiting:
  leakcheck.worker_init_fn(terminate_children=True) does it at worker exit;
- or stop the job's process group when it ends;
- `kill PID` frees one now (the finding gives the PIDs).

growth (leak): a long-lived process holds more GPU memory at each epoch's end.

A process that lives across epochs (the parent, a persistent worker) ends
each epoch holding more GPU memory, beyond the tolerance (16 MiB), after the warm-up epochs;
the rise must go on in the later half of the epochs (a cache that fills and stays flat is not
growth). Reported in MiB/epoch (least squares). Where PIDs cannot be attributed (another PID
namespace) each device's used memory is judged instead.

Fixes:
- in the main process: tensors outlive their epoch. Accumulate loss.item(), not loss; clear
  lists of outputs and caches each epoch; compare torch.cuda.memory_summary() between epochs.
- in a persistent worker: it keeps CUDA tensors across epochs. Keep worker-side caches on
  the CPU (move batches to the GPU in the main process), or bound their size.
- device totals only: run with --pid=host or in the job's PID namespace to see which process
  grows; meanwhile look for tensors or caches kept across epochs.

host-growth (leak): a long-lived process holds more host memory at each epoch's end.

The same as growth for host memory, with its own tolerance (64 MiB over
the judged epochs). Judged on USS, a process's private memory (/proc/PID/smaps_rollup, read
at epoch ends for the parent and persistent workers), or on resident memory where USS was not
read (its anonymous part, RssAnon, where known), which the finding says: resident memory
counts pages shared with other processes and does not show copy-on-read. Where USS, read at
the first ends only, saw no growth, RssAnon at every end is judged too. A parent whose USS
climbs back after its workers forked (its pages become its own again as they stop sharing
them) is not growing unless its resident memory grows too.

Copy-on-read is the classic cause: a dataset of Python objects (lists, dicts, strings) has
its reference counts written by every read, so each forked worker copies the pages it reads.

Fixes:
- keep the data in numpy arrays, Arrow tables or tensors (strings as one bytes buffer with
  offsets) instead of Python objects;
- persistent_workers=True keeps each worker's copies for the whole run (False gives them back
  each epoch, at the cost of starting workers), and each worker more is one copy more;
- bound the caches a worker fills;
- in the main process: drop what the loop keeps (outputs, losses as tensors, growing lists
  and caches) and compare tracemalloc snapshots between epochs.

Information (not a leak): where some judged epoch ends of a forked worker had resident memory
only (USS reads are paced to 0.1% of the time), a clean verdict says at how many USS was read;
for a diagnostic run read it at every epoch end: watch(..., rollup_share=1.0),
LeakCheckCallback(rollup_share=1.0) or leakcheck run --rollup-share 1.

copy-on-read (leak): forked workers copied their parent's memory, one copy per worker.

A forked worker shares its parent's memory at birth. A dataset of Python objects (lists,
dicts, strings) has its reference counts written by every read, so each worker turns the
pages it reads into private copies: N workers hold N copies. Measured per worker from its
birth (a reading it posts as it starts) to each later reading (epoch ends, inside epochs
longer than 10 s, its exit): copied = min(shared dirty memory lost, private dirty memory
gained), so new allocations (private up, shared flat) are not counted. A leak when the copy
per worker passes the copy tolerance (64 MiB: --copy-tolerance, copy_tolerance=,
--gpu-leak-copy-tolerance). Found in the epoch it happens in, usually epoch 0, and flat
afterwards, which a growth rule never sees. Per-epoch workers copy again each epoch.

Spawn and forkserver workers share nothing with the training process at birth: for them
copy-on-read cannot be told, and one info line gives their private memory instead.

Fixes:
- keep the data in numpy arrays, Arrow tables or tensors (strings as one bytes buffer with
  offsets) instead of Python objects: their pages are not written by reads;
- call gc.freeze() in the parent before iterating: the collector then leaves the objects'
  headers alone in the workers too;
- fewer workers: each worker more is one copy more.

residual (leak): GPU memory is left after the work that nothing of the job should hold.

After the work, a GPU uses more memory than at the start and no process of
the job explains it (the tolerance, plus 8 MiB per live context, is allowed). Under pytest,
also the test process's own memory: CUDA tensors it still holds (torch's allocator, after
gc.collect() and empty_cache()) or driver memory it allocated outside torch.

Fixes:
- a foreign process holds it: if it is yours (a child that escaped the lineage, another run),
  stop it; otherwise run on an idle GPU (CUDA_VISIBLE_DEVICES) or raise the tolerance;
- nobody visible holds it: a process in another PID namespace, or a context still being torn
  down; check again with `leakcheck snapshot` after a few seconds;
- tensors kept by the test process: drop references to CUDA tensors the work creates
  (module-level lists, caches, globals, stored exceptions and tracebacks), or free them in a
  fixture finalizer;
- memory outside torch: free what the work allocates outside torch (library memory pools, raw
  allocations); one-time library loading counts here too: raise the tolerance.
Where per-process bytes are unknown (MIG, vGPU) the rise is information, not a leak.

shm (leak, or information): a file the work made in /dev/shm is still there after it.

Its name tells its cause:
- cuda.shm.*: CUDA IPC, workers returned CUDA tensors through the loader's queues. Return
  CPU tensors from workers and move or pin them in the main process (pin_memory=True).
- torch_*: torch's shared tensors (the file_system sharing strategy). Let the loader's
  iterators finish or `del` them so their workers free their segments; prefer the default
  file_descriptor strategy. An empty one (a size, no memory in it) is a segment torch could
  not reserve because /dev/shm was full: give the job more (--shm-size, --ipc=host).
- psm_*: a multiprocessing SharedMemory never unlinked. Call unlink() (close() alone leaves
  the file), or create it in a fixture or try/finally that unlinks it.
- nccl-*: a process group not destroyed: call torch.distributed.destroy_process_group().
- anything else: the work's own; unlink it (SharedMemory.unlink(), os.unlink).
Named semaphores (sem.*) are not judged. Information, not blame, when a process of the job
still holds the file as tracking ends, when nothing ties it to the job (no process of the
job holds it, its name carries none of their PIDs, the watching process did not make it:
another job's, or a gone child's, cannot be told apart), or when its name says an older
process made it.

Information too when /dev/shm was 80% full or more during an epoch: workers die of a bus
error ("insufficient shared memory") when it fills; Docker gives a container 64 MB unless
told otherwise. Give the job more (docker run --shm-size=8g or --ipc=host; Kubernetes: an
emptyDir volume with medium: Memory at /dev/shm), or pass less through it at once (fewer
workers, a smaller prefetch_factor, smaller batches).

died (leak): a process of the job was ended by a signal, and the evidence says why.

A signal names no sender, so the finding says only what was read as the death was noted
(watch() notes each worker of a failed epoch: the DataLoader's own error still follows):
- killed by the OOM killer (SIGKILL, and the memory cgroup counted an OOM kill, or the
  machine had almost no memory available): "DataLoader worker (pid X) is killed by signal:
  Killed". The finding gives what the worker held at the last read and its growth since
  birth. Find what grows (the host-growth and copy-on-read findings: a dataset of Python
  objects is copied into every forked worker), use fewer workers or a smaller
  prefetch_factor, or give the job more memory (a container's --memory, a pod's limit).
- /dev/shm exhausted (SIGBUS, /dev/shm at 80% or more in the epoch): "Bus error",
  "insufficient shared memory". Docker gives a container 64 MB: docker run --shm-size=8g or
  --ipc=host (Kubernetes: an emptyDir with medium: Memory at /dev/shm), or
  torch.multiprocessing.set_sharing_strategy('file_system'), or pass less at once.
- a crash in native code (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE): the finding shows the
  innermost frames of the Python stack the worker's faulthandler wrote (the report shows the
  whole of it). Common causes: a C extension's bug, a library that is not fork-safe used in
  forked workers (start them with multiprocessing_context="spawn"), threads of OpenCV or
  OpenMP started before the fork (cv2.setNumThreads(0)).
- killed by a signal, sender unknown: no OOM kill was counted and memory was not full. A
  job scheduler's time or memory limit, another user's kill, a watchdog: look in the
  scheduler's and the kernel's logs (dmesg).

fd-pressure (information): a process of the job holds 80% or more of its open descriptors.

Counted at each epoch end against the process's own soft RLIMIT_NOFILE. PyTorch's default
sharing strategy (file_descriptor) passes each shared tensor of a batch as a descriptor, held
until the tensor is freed: many workers, a large prefetch_factor, or batches kept in a list
hold thousands. At the limit: "Too many open files", "received 0 items of ancdata".
Fixes: raise the limit before starting (ulimit -n 65536; a container's --ulimit nofile=...),
or torch.multiprocessing.set_sharing_strategy('file_system') in the main process (its files
live in /dev/shm: watch the shm rule), or keep fewer batches alive at once. A descriptor
leak (files or sockets opened per item and never closed) grows at every epoch: close them.

hang (information): an epoch waited hang_after seconds for a batch; here is where each waits.

When no batch comes for hang_after seconds (watch(hang_after=120); 0 turns it off),
leakcheck writes once per stall, to stderr and into the report, the Python stacks of every
thread of the loop's process (the pin-memory thread among them) and of each worker (its
faulthandler writes them on SIGUSR2, which leakcheck sends only to the job's own workers).
The loop goes on: a slow batch ends the stall by itself.
Read the stacks:
- a worker in your __getitem__ (a network read, a lock, a subprocess): give it a timeout;
  the DataLoader's own timeout= turns a stuck worker into an error.
- a worker stuck in a lock right after fork (a logging handler's, a thread pool's, a
  library's): threads in the parent at fork time leave their locks held in the child; start
  workers with multiprocessing_context="spawn" or "forkserver".
- the loop's thread in queue.get with every worker idle: the sampler or batch_sampler
  yields nothing more (a distributed sampler whose ranks disagree on the length).
- the loop's thread in your own code: the training step itself is slow (not a hang).

pinned-growth (leak): the loop's process holds more pinned host memory at each epoch's end.

Read at each epoch end from torch.cuda.host_memory_stats() (the caching host allocator, what
pin_memory=True and tensor.pin_memory() use) where CUDA is initialised in the loop's process;
judged as growth, on the bytes the allocator holds (16 MiB tolerance). Pinned pages cannot
be swapped out: growing, they take the machine's memory from everything else.
Fixes: keep no reference to pinned batches past their step (lists of batches, inputs kept
with outputs); allocate a pinned buffer once and copy into it, not per step.

shutdown-hang (information): a worker did not exit in its DataLoader's join time at shutdown.

A DataLoader iterator's shutdown (an epoch's end, a break, del) joins each worker for 5 s,
then terminates it. leakcheck writes that worker's stacks (every thread) to stderr and the
report first. Read them: a __getitem__ still running (give its reads a timeout); a non-daemon
thread the worker started (make it daemon=True, or stop it at exit); a worker_init_fn that
blocks.

device-mismatch (leak): a rank's process holds memory on a GPU that is not its rank's.

A process of a distributed rank (the rank, a worker, a grandchild)
holds more than the tolerance on a GPU that is not its rank's: LOCAL_RANK's device (through
CUDA_VISIBLE_DEVICES), or the one the rank chose with torch.cuda.set_device. Usually a bare
'cuda' or cuda:0 before set_device, which costs every rank a context (~0.5 GiB) on GPU 0. A
rank that uses several GPUs on purpose is flagged too: one device per rank is assumed.

Fixes: call torch.cuda.set_device(LOCAL_RANK) (or pass device=f'cuda:{LOCAL_RANK}') before
anything touches CUDA in the rank; never use a bare 'cuda' or cuda:0 in workers, collate or
pin-memory code; or give each rank only its GPU with CUDA_VISIBLE_DEVICES.

blind (information, never "clean"): GPU memory cannot be attributed to processes.

NVML's PIDs are from another PID namespace (a container
without --pid=host), so GPU memory cannot be attributed to processes: only device totals are
judged. Run with --pid=host (docker), or inside the job's PID namespace.

descriptor-holder (information): a process holds /dev/nvidia* descriptors, no GPU memory.

A process of the job holds /dev/nvidia* descriptors but no
GPU memory, and outlives the work that started it (an orphan, a descendant alive at an
epoch's end, anything alive once tracking ended). Forked from a parent that used CUDA, it
inherited them, and they can keep the parent's CUDA context pinned. A loader's live workers
are not named: healthy persistent workers forked from a CUDA parent hold them while they work.

Fixes: start workers with multiprocessing_context='spawn' or 'forkserver', or do not
initialise CUDA in the parent before workers fork.

context-kept (information): the parent keeps its CUDA context with no tensors left.

The parent keeps its CUDA context (~0.5 GiB) after all its
tensors are gone. Harmless: the CUDA runtime frees it at exit. If the GPU must be free before
then, call leakcheck.release_device().

high-clocks (information): a GPU stays at high clocks after the work.

A GPU stays at high SM clocks after the work ended, with no
memory of the job on it. The driver lowers clocks after some idle seconds: wait before timing
the next run (leakcheck sweep --cooldown-temp C waits for it); leakcheck.release_device()
frees a context that keeps the GPU busy.

tracker-failure (information): leakcheck itself could not read something.

While sampling, leakcheck never raises into your loop: it records what failed, and the
timeline may miss samples. Read the line; rerun with strict=True (Tracker(strict=True)) to
see the traceback, and report it as a leakcheck bug.
"""

_TITLE = re.compile(r"\n(?=[a-z-]+ \((?:leak|information)[^)\n]*\): )")  # a story's first line

STORIES: Mapping[str, str] = {story.split(" ", 1)[0]: story for story in _TITLE.split(_TEXT)}
"""Every rule's story, by rule name (``_TEXT`` cut before each title, ``rule (kind): ...``)."""


def headline(rule: str) -> str:
    """The first line of a rule's story, without the rule's name: what it finds."""
    return STORIES[rule].split("\n", 1)[0].split(": ", 1)[1]
