"""Small predicates and builders shared by the passes.

Every node a pass inserts goes through `GraphBuilder.call`, which computes its
`meta["val"]` by running the op on the fake values of its arguments, so
`meta["val"]` stays correct after every rewrite (Inductor lowers from it).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

c10d = torch.ops._c10d_functional

COLLECTIVES = {
    c10d.all_reduce.default: "all_reduce",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.all_to_all_single.default: "all_to_all",
}
META_KEY = "gradsched"  # node.meta[META_KEY]: a dict tag left by the grad-sync pass


def is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in COLLECTIVES


def collective_kind(n: fx.Node) -> str:
    return COLLECTIVES[n.target]


def collective_group(n: fx.Node) -> str:
    """Group name argument of a functional collective (its last positional arg)."""
    return n.args[-1]


def fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is not None:
            return v.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _val(a):
    return a.meta["val"] if isinstance(a, fx.Node) else a


class GraphBuilder:
    """Insert nodes before `anchor` (or at the graph's end) with correct meta["val"]."""

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode | None = None):
        self.gm, self.graph = gm, gm.graph
        self.fake_mode = fake_mode or fake_mode_of(gm)

    def call(self, target, *args, tag: dict | None = None, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fargs = torch.utils._pytree.tree_map(_val, (args, kwargs))
        with self.fake_mode:
            node.meta["val"] = target(*fargs[0], **fargs[1])
        if tag is not None:
            node.meta[META_KEY] = tag
        return node

    def placeholder(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> fx.Node:
        """A new input, placed after the existing ones (callers append the argument). Its value
        is made in the graph's fake mode, so any device works (CUDA on a CPU-only machine)."""
        last = [n for n in self.graph.nodes if n.op == "placeholder"]
        with self.graph.inserting_before(last[-1].next if last else None):
            node = self.graph.placeholder(name)
        with self.fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        return node

    # ---- ops used by the grad-sync pass ---------------------------------------------
    def flat(self, x: fx.Node, dtype: torch.dtype) -> fx.Node:
        x = self.call(torch.ops.aten.reshape.default, x, [-1])
        if x.meta["val"].dtype != dtype:
            x = self.call(torch.ops.prims.convert_element_type.default, x, dtype)
        return x

    def after(self, x: fx.Node, node: fx.Node) -> fx.Node:
        """x, bit for bit, read through a zero computed from `node`: whatever reads the result runs after
        `node` in every schedule (the passes' ordering guarantees are data dependences, which no compiler
        may reorder)."""
        return self.call(torch.ops.aten.sub.Tensor, x, self.zero_from(node, x.meta["val"].dtype))

    def zero_from(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        """+0.0 computed from node's first element (never -0.0, never NaN)."""
        aten = torch.ops.aten
        one = self.call(aten.slice.Tensor, self.call(aten.reshape.default, node, [-1]), 0, 0, 1)
        one = self.call(torch.ops.prims.convert_element_type.default, one, torch.float32)
        size = self.call(aten.abs.default, one)
        zero = self.call(aten.mul.Tensor, size, 0.0)  # abs: never -0.0
        finite = self.call(aten.lt.Scalar, size, float("inf"))  # False for inf and NaN
        zero = self.call(aten.where.ScalarOther, finite, zero, 0.0)  # never NaN (decomposed ops: Inductor lowers them)
        return self.call(torch.ops.prims.convert_element_type.default, zero, dtype)

    def collective(self, kind: str, x: fx.Node, group: str, group_size: int, tag: dict) -> fx.Node:
        """Issue a functional collective and wait for it; both nodes carry `tag`."""
        if kind == "all_reduce":
            c = self.call(c10d.all_reduce.default, x, "sum", group, tag=tag)
        elif kind == "reduce_scatter":
            c = self.call(c10d.reduce_scatter_tensor.default, x, "sum", group_size, group, tag=tag)
        else:
            raise ValueError(kind)
        return self.call(c10d.wait_tensor.default, c, tag={**tag, "wait": True})


# ---- a node's value and source ------------------------------------------------------------------

def fake_value(node) -> torch.Tensor | None:
    """The fake tensor a node stands for (AOT's meta["val"], Dynamo's meta["example_value"]), if any."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val", node.meta.get("example_value"))
    return v if isinstance(v, torch.Tensor) else None


def set_fake(node: fx.Node, val) -> None:
    """Record a new node's value under both keys, so Dynamo-level and AOT-level readers see it."""
    if val is not None:
        node.meta["val"] = val
        node.meta["example_value"] = val


def copy_meta(src: fx.Node, dst: fx.Node) -> None:
    """A replacement node keeps the replaced one's value and source (what refusals and reports name)."""
    for key in ("val", "example_value", "stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def stack_frames(stack_trace: str | None) -> list[tuple[str, str]]:
    """('File "f", line n, in fn', its code line) for each frame of a node's stack trace
    (node.meta["stack_trace"]), outermost first."""
    lines = (stack_trace or "").strip().splitlines()
    return [(line.strip(), lines[i + 1].strip() if i + 1 < len(lines) else "")
            for i, line in enumerate(lines) if line.strip().startswith('File "')]
