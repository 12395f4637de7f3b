"""Put the outputs in docs/cpu/ and docs/h200/ into README.md and docs/FAILURES.md.

Each quoted output follows a marker line ``<!-- output: docs/cpu/NAME.txt -->`` (with
`` from: REGEX`` and `` to: REGEX`` before ``-->``: from the first line that matches, up to the
next that does) and is the fenced block
right after it; this replaces the block with the file, less what a reader does
not need: progress lines, library warnings and chatter, the program's own prints, and the
middle epochs of a sweep's table. ``--check`` exits 1 when either is not up to date.
Run tools/readme_cpu.sh (and tools/gpu_readme.sh on the GPU machine) first.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- output: (\S+)(?: from: (.+?))?(?: to: (.+?))? -->$")
NOISE = (
    re.compile(r"^leakcheck sweep: config \d+/\d+ "),  # progress
    re.compile(r"UserWarning|^\s+self\.check_worker_number_rationality\(\)|^\s+warnings\.warn"),
    re.compile(r"^(GPU|TPU) available|^💡 Tip|_pytree\.py|^`Trainer\.fit` stopped"),
    re.compile(r"^done$|^rank \d+ epoch \d+ loss "),  # the example programs' own prints
    re.compile(r"^(platform|rootdir|configfile|plugins|cachedir)[: ]"),
)
TABLE_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s")


def abridge(text: str) -> list[str]:
    """The lines of an output worth quoting; a sweep's table keeps each first and last epoch."""
    lines = [line for line in text.splitlines() if not any(p.search(line) for p in NOISE)]
    epochs: dict[int, int] = {}  # line index -> epoch, for the rows of the epoch table
    in_table = False
    for index, line in enumerate(lines):
        row = TABLE_ROW.match(line)
        if line.startswith("workers  epoch "):
            in_table = True
        elif in_table and row:
            epochs[index] = int(row.group(2))
        else:
            in_table = False
    last = max(epochs.values(), default=0)
    return [line for i, line in enumerate(lines) if epochs.get(i, 0) in (0, last)]


def fill(readme: str) -> str:
    """The README with every marked block replaced by its output file, abridged."""
    out: list[str] = []
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        out.append(lines[i])
        marker = MARKER.match(lines[i])
        i += 1
        if not marker:
            continue
        if i >= len(lines) or not lines[i].startswith("```"):
            sys.exit(f"readme_outputs: no fenced block after {marker.group(0)}")
        end = lines.index("```", i + 1)
        source = ROOT / marker.group(1)
        if source.is_file():
            quoted = abridge(source.read_text())
            if marker.group(2):  # from the first line that matches, after the command line
                start = next(n for n, ln in enumerate(quoted) if re.search(marker.group(2), ln))
                quoted = [quoted[0], "...", *quoted[start:]]
            if marker.group(3):  # up to the first line after those that matches
                stop = next(
                    (n for n, ln in enumerate(quoted) if n > 2 and re.search(marker.group(3), ln)),
                    len(quoted),
                )
                quoted = [*quoted[:stop], "..."]
            out.extend(["```", *quoted, "```"])
        else:  # left as it was, and said
            print(f"readme_outputs: {marker.group(1)} not found; its block kept", file=sys.stderr)
            out.extend(lines[i : end + 1])
        i = end + 1
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args()
    stale = False
    for path in (ROOT / "README.md", ROOT / "docs" / "FAILURES.md"):
        now = path.read_text()
        filled = fill(now)
        stale |= filled != now
        if not args.check:
            path.write_text(filled)
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
