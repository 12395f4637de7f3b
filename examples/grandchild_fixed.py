"""The helper process of grandchild_leak.py, stopped with its worker.

``leakcheck.worker_init_fn(terminate_children=True)`` makes each worker, at exit, SIGTERM
(then SIGKILL) the live descendants it started, identified by psutil as it listed them; watch()
keeps that setting when it chains its own policy. Better still, a dataset that starts a
helper stops it itself; this is the net for the ones that do not. The report is clean.

Run: python examples/grandchild_fixed.py
"""

from __future__ import annotations

import tempfile

from grandchild_leak import make_loader

import leakcheck


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        loader = make_loader(
            folder, worker_init_fn=leakcheck.worker_init_fn(terminate_children=True)
        )
        with leakcheck.watch(loader, grace=1.0) as watched:
            for _batch in watched:
                pass
        print(watched.report().format())


if __name__ == "__main__":
    main()
