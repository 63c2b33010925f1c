"""benchmarks/cpu_peak.py, the measure behind memory.py's and pipeline.py's peaks: it counts every thread's
allocations and frees. Run in a child process: installing it replaces the CPU allocator for good."""
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import torch, cpu_peak
cpu_peak.install()
MiB = 2 ** 20

def elsewhere(fn):
    t = threading.Thread(target=fn); t.start(); t.join()

cpu_peak.reset()
held = [torch.empty(MiB, dtype=torch.uint8)]   # 1 MiB made here ...
elsewhere(held.clear)                          # ... freed on another thread
b = torch.empty(2 * MiB, dtype=torch.uint8); del b
print(cpu_peak.peak() // MiB)                  # 2: the first was gone before the second came

cpu_peak.reset()
made = []
elsewhere(lambda: made.append(torch.empty(3 * MiB, dtype=torch.uint8)))  # made on another thread, kept here
c = torch.empty(MiB, dtype=torch.uint8)
print(cpu_peak.peak() // MiB)                  # 4: both alive at once
del c, made[:]
print(cpu_peak.peak() // MiB, cpu_peak.alive())         # 4 0: the peak stays, nothing alive
"""


def test_cpu_peak_counts_frees_and_allocations_made_on_other_threads():
    benchmarks = str(Path(__file__).resolve().parent.parent / "benchmarks")
    out = subprocess.run([sys.executable, "-c", CHILD, benchmarks], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "4", "4", "0"]
