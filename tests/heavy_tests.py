"""Writes tests/heavy_tests.txt: the tests whose phases (setup, call, teardown) took over THRESHOLD seconds in a
suite run's `--durations=0` report. conftest.py marks them `heavy`, and the fast tier deselects them
(docs/testing.md). Regenerate it after a full run:

    python -m pytest -q -n 2 --dist loadfile --durations=0 > suite.log; python tests/heavy_tests.py suite.log
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

THRESHOLD = 3.0
LIST = Path(__file__).with_name("heavy_tests.txt")
LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)")


def heavy(report: str, threshold: float = THRESHOLD) -> dict[str, float]:
    """The test ids of a --durations report whose phases sum to more than `threshold` seconds, with those
    seconds, sorted by id."""
    seconds = Counter()
    for line in report.splitlines():
        if m := LINE.match(line):
            seconds[m.group(3)] += float(m.group(1))
    return {t: s for t, s in sorted(seconds.items()) if s > threshold}


def listed_seconds(path: Path = LIST) -> dict[str, float]:
    """The test ids the list names (its comment lines skipped), each with its measured seconds ("ID SECONDS"; an
    id written without them counts the threshold)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            test, _, secs = line.partition(" ")
            out[test] = float(secs) if secs.strip() else THRESHOLD
    return out


def listed(path: Path = LIST) -> set[str]:
    """The test ids the list names."""
    return set(listed_seconds(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path, help="the output of a pytest run with --durations=0")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="seconds (default %(default)s)")
    args = p.parse_args()
    ids = heavy(args.log.read_text(encoding="utf-8", errors="replace"), args.threshold)
    LIST.write_text(f"# tests over {args.threshold:g} s in {args.log.name} (tests/heavy_tests.py), with their seconds; "
                    "marked heavy, and their files run first\n" + "".join(f"{t} {s:.1f}\n" for t, s in ids.items()),
                    encoding="utf-8")
    print(f"{len(ids)} heavy tests written to {LIST}")


if __name__ == "__main__":
    main()
