"""Facts about /dev/nvidia* descriptors and context release on the GPU machine (exploration)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/dev/nvidia"):
            out.append(link)
    return sorted(out)


def main() -> None:
    facts: dict[str, object] = {"start": targets()}
    from leakcheck import nvml

    nvml.get().processes()
    facts["after_nvml"] = targets()
    import torch

    facts["torch"] = torch.__version__
    torch.zeros(1, device="cuda")
    facts["after_cuda"] = targets()
    facts["after_cuda_count"] = len(targets())
    pid = os.getpid()
    facts["nvml_self_bytes"] = [
        p.used_gpu_bytes for p in nvml.get().processes() if p.pid == pid
    ]
    child = subprocess.run(
        [sys.executable, "-c", "import os;print(sorted(os.readlink(f'/proc/self/fd/{f}') for f in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{f}')))"],
        capture_output=True, text=True,
    )
    facts["exec_child_fds"] = child.stdout.strip()[:400]
    r, w = os.pipe()
    kid = os.fork()
    if kid == 0:
        os.write(w, json.dumps(targets()).encode())
        os._exit(0)
    os.waitpid(kid, 0)
    facts["forked_child_fds"] = json.loads(os.read(r, 65536).decode())
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
