"""How often an idle tracker without NVML samples: one walk per ``WALK_EVERY`` ticks.

With nothing to read between walks, the sampler's thread sleeps through three ticks in four
(NOTE [idle ticks] in leakcheck/track/pacing.py). The tests assert what the thread asks
for (tests/test_tracker.py) and that it never takes more samples than walking ticks; the pace
itself is a rate, which a loaded machine lowers, so it is measured here: samples per second
of a tracker over an idle epoch against the one walk per ``interval * WALK_EVERY`` that the
pacing plans. Goal: at least half of it on an idle host (the test asserted so until its
machine's load made it fail).

Usage: python benchmarks/bench_idle_ticks.py [--seconds 5] [--interval 0.01] [--write]
       (--write: benchmarks/results/idle-ticks-<machine>.md, see results_io.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_io import host_meta, result_stem, write_result

from leakcheck.track import pacing
from leakcheck.track.tracker import Tracker

GOAL_SHARE = 0.5
"""The least share of the planned walks an idle host should take."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--interval", type=float, default=0.01)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    with Tracker(grace=0.0, interval=args.interval, use_nvml=False) as tracker, tracker.epoch():
        time.sleep(0.2)  # past the first ticks
        before, started_s = tracker.cost().samples, time.monotonic()
        time.sleep(args.seconds)
        taken = tracker.cost().samples - before
        elapsed_s = time.monotonic() - started_s
    planned = elapsed_s / (args.interval * pacing.WALK_EVERY)
    share = taken / planned
    verdict = "met" if share >= GOAL_SHARE else "NOT met"
    text = (
        f"# Idle ticks without NVML\n\n"
        f"{taken} samples in {elapsed_s:.2f} s at a {args.interval * 1000:g} ms interval; "
        f"planned {planned:.1f} (one per {pacing.WALK_EVERY} ticks): {share:.2f} of the plan, "
        f"goal >= {GOAL_SHARE} {verdict}."
    )
    print(text)
    if args.write:
        payload = {
            **host_meta(),
            "interval_s": args.interval,
            "walk_every": pacing.WALK_EVERY,
            "elapsed_s": elapsed_s,
            "samples": taken,
            "planned": planned,
            "share": share,
            "goal_share": GOAL_SHARE,
        }
        print(write_result(result_stem("idle-ticks"), payload, text))
    return 0 if share >= GOAL_SHARE else 1


if __name__ == "__main__":
    sys.exit(main())
