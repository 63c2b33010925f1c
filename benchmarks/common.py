"""What every benchmark does with its measurements: one JSON object per line on stdout, and the same
lines in a file under benchmarks/results/."""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def emit(rows: list[dict], out: str | Path | None) -> None:
    for row in rows:
        print(json.dumps(row), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {out}", file=sys.stderr)
