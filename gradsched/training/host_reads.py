"""Which lines of a training step read a tensor's value on the host: each one is a device drain on a GPU.

On a GPU a step is fast while the CPU runs ahead of the device. `.item()`, `.tolist()`, `bool(t)`, `.cpu()`
and their kin wait until the device has finished everything queued before them. On a CPU nothing is
asynchronous, so such reads cost nothing there and are easy to add unnoticed: record them instead.

    with host_reads.recording() as reads:
        model.train_step(x, y); opt.step()
    assert not reads.unexpected(), reads.report()

Implemented by patching torch.Tensor's value-reading methods for the duration (and restoring them), on the
thread that entered: a TorchFunctionMode around compiled code would make Dynamo guard on the mode and
recompile the very graphs under test. Reads of meta tensors (no value) are not recorded, and reads known to
stay on the host by design (torch's optimizers keep their step counters on the CPU unless capturable or
fused) are recorded as expected. What compiled C++ reads internally is not seen: this audits Python.
"""
from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass, field

import torch

METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")

# (file suffix, function): reads that are no device read on a GPU, or are gradsched's one allowed read a step
EXPECTED = {
    ("torch/optim/optimizer.py", "_get_value"): "torch's optimizers keep state['step'] on the CPU",
    ("gradsched/sync/nonfinite.py", "check"): "gradsched's one read a step, at its end: the non-finite flags",
}


@dataclass
class Read:
    method: str
    shape: tuple
    device: str
    stack: list  # traceback.FrameSummary, outermost first
    expected: str | None = None  # why it is no device read in the steady state, when it is not

    def where(self) -> str:
        f = self.stack[-1]
        return f"{f.filename}:{f.lineno} in {f.name}"

    def text(self) -> str:
        head = f"Tensor.{self.method}() of a {list(self.shape)} tensor on {self.device}, at {self.where()}"
        frames = "".join(traceback.format_list(self.stack[-12:]))
        return head + "\n" + frames


@dataclass
class Reads:
    all: list = field(default_factory=list)

    def unexpected(self) -> list:
        return [r for r in self.all if r.expected is None]

    def report(self) -> str:
        bad = self.unexpected()
        return (f"{len(bad)} host read(s) of a tensor's value (each a device drain on a GPU):\n\n" +
                "\n".join(r.text() for r in bad))


def _expected(stack: list) -> str | None:
    for f in reversed(stack):
        name = f.filename.replace("\\", "/")
        for (suffix, fn), why in EXPECTED.items():
            if name.endswith(suffix) and f.name == fn:
                return why
    return None


@contextlib.contextmanager
def recording():
    """Record every value read of a tensor made on this thread inside the block (see the module's docstring)."""
    reads, me, busy = Reads(), threading.get_ident(), [False]
    originals = {m: getattr(torch.Tensor, m) for m in METHODS}

    def wrap(method, original):
        def read(self, *args, **kwargs):
            if not busy[0] and threading.get_ident() == me and not self.is_meta:
                busy[0] = True  # a read inside a read (tolist -> item) counts once
                try:
                    stack = traceback.extract_stack()[:-1]
                    reads.all.append(Read(method, tuple(self.shape), str(self.device), stack, _expected(stack)))
                    return original(self, *args, **kwargs)
                finally:
                    busy[0] = False
            return original(self, *args, **kwargs)
        read.__name__ = method
        return read

    try:
        for m, original in originals.items():
            setattr(torch.Tensor, m, wrap(m, original))
        yield reads
    finally:
        for m, original in originals.items():
            setattr(torch.Tensor, m, original)
