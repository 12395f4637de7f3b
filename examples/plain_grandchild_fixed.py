"""plain_grandchild_leak.py fixed, still without leakcheck: each worker stops its helper.

At worker start, ``worker_init_fn`` registers the dataset's ``stop_helper`` to run when the
worker process exits (``multiprocessing.util.Finalize`` runs in every worker, forked or
spawned), so the helper ends with its worker. ``leakcheck run`` reports it clean:

    leakcheck run -- python examples/plain_grandchild_fixed.py
"""

from __future__ import annotations

import multiprocessing.util
import tempfile

from plain_grandchild_leak import WithHelper, make_loader
from torch.utils.data import get_worker_info


def stop_helper_at_exit(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None  # called in a worker
    assert isinstance(info.dataset, WithHelper)
    multiprocessing.util.Finalize(None, info.dataset.stop_helper, exitpriority=100)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        loader = make_loader(folder, worker_init_fn=stop_helper_at_exit)
        for _batch in loader:
            pass
        print("done")


if __name__ == "__main__":
    main()
