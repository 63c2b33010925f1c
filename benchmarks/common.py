"""What every benchmark does with its measurements: one JSON object per line on stdout, and the same
lines in a file under benchmarks/results/."""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# the example model and its training harness live in examples/, outside the package
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def keep_freed_memory() -> None:
    """glibc's malloc keeps what is freed for reuse in the processes started after this call (the ranks: they
    inherit the environment), as the CUDA caching allocator does on a GPU and jemalloc or tcmalloc on a CPU
    (torch's CPU tuning guide). By default glibc hands a large free at the top of its heap back to the OS and
    the next allocation of that size page-faults it in again: a compiled backward's weight gradients, alive
    together at its end and freed together after they are added into .grad, cost ~100K page faults (400 MB) a
    step on each rank at pp 2 here (zb1p, 8 micro-batches: 150-220 ms of a rank's W a step, of a ~1 s step), where
    torch's eager backward, freeing each as it goes, cost 6-18K.
    Every side of a comparison runs with it. Settings already in the environment are kept."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))  # glibc's largest: below it, from the heap
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 40))  # never hand the heap's top back


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


def peak_increment(prof) -> int:
    """The most bytes alive over the profiled region above those alive at its start: the CPU allocator's
    running total, which the profiler records with every allocation and free in or outside an op, on the
    threads it profiles. A free on another thread (gloo's worker releasing a collective's buffer) is never
    subtracted, so use this for one thread's work only; benchmarks/cpu_peak.py counts every thread.
    The events' own memory columns are not enough: an allocation outside any op (Inductor's buffers, a
    collective's) is counted at its enclosing event's start together with its free, so peaks vanish."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree
    allocs = sorted((e for e in OpTree(prof.profiler.kineto_results).dfs() if e.typed[0] == _EventType.Allocation
                     and e.typed[1].device.type == "cpu"), key=lambda e: e.start_time_ns)
    if not allocs:
        return 0
    first = allocs[0].typed[1]
    base = first.total_allocated - first.alloc_size  # the total just before the first event
    return max(0, max(e.typed[1].total_allocated for e in allocs) - base)
