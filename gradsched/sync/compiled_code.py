"""Read what a graph's Inductor output code does, in the order it does it.

The generated `call()` is the truth of what runs: its collectives, their waits
and its compute kernels, line by line. Benchmarks and tests read overlap from
here, not from the plan that asked for it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

_COLLECTIVE = re.compile(r"torch\.ops\._c10d_functional\.(reduce_scatter_tensor|all_reduce_?|all_gather_into_tensor|"
                         r"all_to_all_single)\.default\((\w+),.*'([^']*)'\)")
_AGREE = re.compile(r"torch\.ops\.gradsched\.agree\.default\((\w+),")
_ASSIGNED = re.compile(r"^\s*(\w+) = ")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
_COMPUTE = re.compile(r"^\s*(?:\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+)\(")
_ALLOC = re.compile(r"^\s*(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
_VIEW = re.compile(r"^\s*(\w+) = reinterpret_tensor\((\w+), \(([^)]*)\)")
_ALIAS = re.compile(r"^\s*(\w+) = (\w+); del \w+")


@dataclass(frozen=True)
class Event:
    line: int  # index among the lines of call()
    kind: str  # "collective" | "wait" | "compute" | "agreement" (gradsched.sync.agreement_check's gather, its wait)
    op: str
    buffer: str = ""  # a collective's input (a wait's argument)
    group: str = ""  # a collective's group name
    nbytes: int = 0  # a collective's input size


def call_lines(source: str) -> list[str]:
    """The body of the generated `call` function."""
    lines, inside = [], False
    for line in source.splitlines():
        if re.match(r"\s*def call\(", line):
            inside = True
            continue
        if inside and re.match(r"\S", line):  # back at module level
            break
        if inside:
            lines.append(line)
    if not lines:
        raise ValueError("no call() function in this code: is it Inductor's output code?")
    return lines


def events(source: str) -> list[Event]:
    lines = call_lines(source)
    buffers = {}  # name -> (numel, dtype) as allocated or viewed so far
    agreed = {m[1] for line in lines if (m := _AGREE.search(line))}  # the agreements' gathered digests
    out = []
    for i, line in enumerate(lines):
        if m := _ALLOC.match(line):
            buffers[m[1]] = (_numel(m[2]), getattr(torch, m[3]))
        elif m := _VIEW.match(line):
            buffers[m[1]] = (_numel(m[3]), buffers.get(m[2], (0, None))[1])
        elif m := _ALIAS.match(line):
            buffers[m[1]] = buffers.get(m[2], (0, None))
        if (m := _COLLECTIVE.search(line)) and (a := _ASSIGNED.match(line)) and a[1] in agreed:
            out.append(Event(i, "agreement", m[1], m[2], m[3]))
        elif (m := _WAIT.search(line)) and m[1] in agreed:
            out.append(Event(i, "agreement", "wait_tensor", m[1]))
        elif m := _COLLECTIVE.search(line):
            numel, dtype = buffers.get(m[2], (0, None))
            if dtype is None:
                raise ValueError(f"collective on {m[2]}, whose allocation the code does not show: {line.strip()}")
            out.append(Event(i, "collective", m[1], m[2], m[3], numel * dtype.itemsize))
        elif m := _WAIT.search(line):
            out.append(Event(i, "wait", "wait_tensor", m[1]))
        elif m := _COMPUTE.match(line):
            out.append(Event(i, "compute", m[1]))
    return out


def bytes_before_last_compute(source: str, group: str) -> tuple[int, int]:
    """(bytes of `group`'s collectives issued before the code's last compute kernel, all of them)."""
    ev = events(source)
    last = max((e.line for e in ev if e.kind == "compute"), default=-1)
    mine = [e for e in ev if e.kind == "collective" and e.group == group]
    return sum(e.nbytes for e in mine if e.line < last), sum(e.nbytes for e in mine)


def kernels_left(source: str, group: str) -> list[tuple[int, float]]:
    """Per collective of `group`: (its bytes, the fraction of the code's compute kernels still to
    run when it is issued). Near 1: issued early, with most of the compute left to hide it."""
    ev = events(source)
    kernels = [e.line for e in ev if e.kind == "compute"]
    return [(e.nbytes, sum(k > e.line for k in kernels) / max(1, len(kernels)))
            for e in ev if e.kind == "collective" and e.group == group]


def _numel(dims: str) -> int:
    return math.prod(int(d) for d in dims.replace(" ", "").split(",") if d)
