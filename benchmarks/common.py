"""What every benchmark does with its measurements: one JSON object per line on stdout, and the same
lines in a file under benchmarks/results/."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# the example model and its training harness live in examples/, outside the package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def emit(rows: list[dict], out: str | Path | None, append: bool = False) -> None:
    """append: add the lines to the file instead of replacing it."""
    for row in rows:
        print(json.dumps(row), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a" if append else "w") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{'appended to' if append else 'wrote'} {out}", file=sys.stderr)


def median_of_slowest(ranks: list[dict], key: str = "step_times") -> float:
    """Median over steps of the slowest rank's time, leaving out the first step (it compiles)
    unless it is the only one. Ranks that timed nothing under `key` (a stage with no flush graph)
    are left out; nan when none timed anything."""
    steps = list(zip(*(r[key] for r in ranks if r[key])))
    steps = steps[1:] or steps
    return statistics.median(max(s) for s in steps) if steps else float("nan")
