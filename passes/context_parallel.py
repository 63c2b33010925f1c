"""Lower attention calls to the context-parallel ring (on the Dynamo graph, before AOTAutograd).

Invariant: after `lower_attention_to_ring`, every attention call of a recognised form
(ATTENTION_FORMS: F.scaled_dot_product_attention, aten.scaled_dot_product_attention,
aten._scaled_dot_product_flash_attention_for_cpu, flash-attn's flash_attn_func when
flash-attn is importable, and gradsched.masks.attention, whose window, position ids, padding
and explicit documents (seq_idx) are handed to the ring as they are), in the graph and in the
body of every higher-order op that runs its body inline (INLINE_BODIES: activation checkpointing
in all its forms, wrap, autocast and grad-mode regions, nested compile regions) at any depth,
is a call of `spec.attention` (the runtime's ring,
gradsched.cp.ring_attention.ring_attention, handed in: passes never import the runtime) over
the CP group `spec.cp_group_name`: the same inputs, an output of the same shape and dtype, and
the same meta["val"] / meta["example_value"]. The ring runs forward and backward on
its own, so AOTAutograd traces it like any other function. A recognised call the ring
cannot run (an attn_mask tensor, dropout, heads that GQA cannot group, an odd local
sequence under the load-balanced causal layout, value heads of another size than the query's
over a ring, whose block kernels take one) raises
RingAttentionError here, at compile time (`spec.check` says which). A window no shorter than
the whole sequence hides nothing and counts as no mask when the scheme is chosen (the runtime
drops it too). `spec.check` also returns the scheme each call runs
with: a lowered call carries a concrete comm ("ring", "allgather", "a2a", or "hybrid" with its
a2a_degree), never "auto", when the call's head counts are static. Under
load_balance="documents" every lowered call carries seq_idx and the head-tail layout
(load_balance=True); a call without seq_idx is refused (it would attend across documents that
the reordering interleaved). What was lowered, and which attention-like calls
of other forms were left local, is returned as a ContextParallelReport so a caller can
refuse or warn. An attention call in any other body (a cond branch, a loop, a custom
autograd.Function's) is never lowered: not every rank would run its ring alike. It is reported in
left_local, and `attention_left` finds any attention call left anywhere, at any depth, for the
backend to refuse.

Assumes: the graph is ONE rank's forward on its slice of the sequence, laid out by
gradsched.cp.layout with the same `load_balance`, and every rank of the CP group
compiles the same graph (the ring's collectives must match across ranks). Everything
else in the graph must already be correct on a slice of the sequence: positions come
in through position_ids, and the loss is a sum over local tokens (see cp_layout).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from .graph_utils import copy_meta, fake_value, set_fake, stack_frames
from .sequence_mixing import module_of


class RingAttentionError(ValueError):
    """An attention call that the context-parallel ring cannot run as asked."""


def effective_window(window: int | None, seq_len: int | None) -> int | None:
    """The window a call over seq_len tokens applies: None when it is no shorter than the sequence
    (it hides nothing: plain causal attention). The pass, the ring, its simulation and the report
    all decide this here, so they agree on which calls are masked."""
    return None if window is None or (seq_len is not None and window >= seq_len) else window


@dataclass(frozen=True)
class RingSpec:
    """The CP group, how to lower, and the ring itself (functions of the runtime, passed in)."""
    cp_group_name: str
    cp: int
    attention: Callable  # (q, k, v, group, causal=, scale=, accumulate=, comm=, load_balance=) -> out
    check: Callable  # (call, q_heads=, kv_heads=, local_len=, cp=, causal=, ...) raises RingAttentionError
    causal_default: bool | None = None  # causality of a call that does not state it (None: False)
    accumulate: str = "fp32"
    comm: str = "ring"  # "ring" | "allgather" | "a2a" | "hybrid" | "auto" (resolved per call by `check`)
    load_balance: bool | str = True  # "documents": every call must carry seq_idx (else refused)
    a2a_degree: int | None = None  # comm="hybrid": the all-to-all group size (None: the largest the heads allow)

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CPU_FLASH_PARAMS = ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale")
_FLASH_ATTN_PARAMS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                      "alibi_slopes", "deterministic", "return_attn_probs")


@dataclass(frozen=True)
class AttentionForm:
    """How one attention callable spells its arguments."""
    name: str
    params: tuple[str, ...]
    causal: str  # the parameter that says causal
    scale: str
    seq_major: bool = False  # [B, L, H, D] (flash-attn) instead of [B, H, L, D]
    returns_lse: bool = False  # returns (out, lse, ...) instead of out
    causal_default: bool | None = None  # when the call does not say (None: the spec's default)
    masks: tuple[str, ...] = ()  # mask arguments handed to the ring as they are (gradsched.cp.attention_masks)


SDPA = AttentionForm("scaled_dot_product_attention", _SDPA_PARAMS, "is_causal", "scale")
ATEN_SDPA = AttentionForm("aten.scaled_dot_product_attention", _SDPA_PARAMS, "is_causal", "scale")
CPU_FLASH = AttentionForm("aten._scaled_dot_product_flash_attention_for_cpu", _CPU_FLASH_PARAMS,
                          "is_causal", "scale", returns_lse=True)
FLASH_ATTN = AttentionForm("flash_attn_func", _FLASH_ATTN_PARAMS, "causal", "softmax_scale",
                           seq_major=True)
MASKED = AttentionForm("gradsched.attention", ("q", "k", "v", "causal", "scale", "window", "position_ids",
                                               "key_padding", "seq_idx"), "causal", "scale", causal_default=True,
                       masks=("window", "position_ids", "key_padding", "seq_idx"))
"""gradsched.masks.attention: a window, documents and padding as arguments, not a mask tensor. Found by
the custom op's name (the pass does not import gradsched)."""
_MASKED_OPS = ("gradsched.attention", "gradsched.attention.default")


def _attention_forms() -> dict:
    forms = {
        torch.nn.functional.scaled_dot_product_attention: SDPA,
        torch._C._nn.scaled_dot_product_attention: SDPA,
        torch.ops.aten.scaled_dot_product_attention: ATEN_SDPA,
        torch.ops.aten.scaled_dot_product_attention.default: ATEN_SDPA,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: CPU_FLASH,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: CPU_FLASH,
    }
    try:  # GPU-only optional extra: recognised when installed
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError:
        return forms
    forms[flash_attn.flash_attn_func] = FLASH_ATTN
    forms[flash_attn_interface.flash_attn_func] = FLASH_ATTN
    return forms


ATTENTION_FORMS = _attention_forms()

# Attention the pass does not lower: reported in left_local so the caller can warn.
_OTHER_ATTENTION = ("flex_attention", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                    "_flash_attention_forward", "_efficient_attention_forward")


@dataclass(frozen=True)
class LoweredAttention:
    node: str  # the replaced node's name
    form: str
    causal: bool
    q_heads: int | None
    kv_heads: int | None
    where: str  # the model source line, from the node's stack trace
    comm: str = "ring"  # the scheme it runs with, and why (comm="auto" says what it picked)
    a2a_degree: int = 1
    why: str = ""
    window: int | None = None
    local_len: int | None = None  # one rank's slice of the sequence
    load_balance: bool | str = True  # "documents": the document-balanced layout (gradsched.cp.layout)
    inside: str = ""  # the higher-order op whose body it was lowered in ("activation checkpoint"), or ""
    masks: tuple[str, ...] = ()  # the per-token mask arguments it passes (position_ids, key_padding, seq_idx)


@dataclass
class ContextParallelReport:
    cp: int
    cp_group_name: str
    lowered: list[LoweredAttention] = field(default_factory=list)
    left_local: list[str] = field(default_factory=list)  # "node (target) at where"


def lower_attention_to_ring(gm: fx.GraphModule, spec: RingSpec) -> tuple[fx.GraphModule, ContextParallelReport]:
    """Rewrite gm's attention calls into ring attention over the spec's CP group (in place), in gm's
    graph and in the bodies of the higher-order ops that run their body inline (INLINE_BODIES), at any
    depth; an attention call in any other body is left, and reported in left_local."""
    _check_group(spec.cp_group_name, spec.cp)
    report = ContextParallelReport(spec.cp, spec.cp_group_name)
    _lower_graph(gm, spec, report, inside="", seen=set())
    return gm, report


# Higher-order ops whose body runs once per call, on every rank alike, as if inlined. Activation
# checkpointing (HF's gradient_checkpointing_enable, torch.utils.checkpoint with either use_reentrant,
# a selective context_fn policy: Dynamo makes all of them tag_activation_checkpoint) runs its body again
# in the backward: lowered there, the recomputation recomputes the ring, with the same collectives on
# every rank, and the ring's saved tensors follow the checkpoint's policy like any other op's.
INLINE_BODIES = {"tag_activation_checkpoint": "activation checkpoint", "wrap": "wrap",
                 "wrap_with_set_grad_enabled": "set_grad_enabled region", "wrap_with_autocast": "autocast region",
                 "invoke_subgraph": "nested compile region"}


def _lower_graph(gm: fx.GraphModule, spec: RingSpec, report: ContextParallelReport, inside: str, seen: set) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        bodies = _bodies(gm, node)
        if bodies:
            hop = _target_name(node)
            for body in bodies:
                if id(body) in seen:  # one body called twice (invoke_subgraph): lowered once
                    continue
                seen.add(id(body))
                if hop in INLINE_BODIES:
                    _lower_graph(body, spec, report, inside or INLINE_BODIES[hop], seen)
                else:  # a branch, a loop, a custom autograd.Function: not every rank runs the ring alike
                    report.left_local += [f"{where} inside {hop}'s body, which the ring cannot run in"
                                          for where in attention_left(body)]
            continue
        form = MASKED if str(node.target) in _MASKED_OPS else ATTENTION_FORMS.get(node.target)
        if form is None:
            if _looks_like_attention(node):
                report.left_local.append(_describe(node))
            continue
        report.lowered.append(_lower_one(gm.graph, node, form, spec, inside))
    gm.graph.lint()
    gm.recompile()


def _bodies(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The subgraphs a higher-order op's call runs (its get_attr arguments naming GraphModules)."""
    out = []
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr":
            sub = getattr(gm, a.target, None)
            if isinstance(sub, fx.GraphModule):
                out.append(sub)
    return out


def attention_left(gm: fx.GraphModule) -> list[str]:
    """'node (target) in module at where' for every attention call of a form the pass knows, or of the other
    kernels' forms, anywhere in gm or its subgraphs at any depth. After lowering, anything here runs
    on one rank's slice of the sequence only: the backend refuses it (never local by accident)."""
    found = []
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            if n.op == "call_function" and (str(n.target) in _MASKED_OPS or n.target in ATTENTION_FORMS
                                            or _looks_like_attention(n)):
                found.append(_describe(n))
    return found


def _describe(node: fx.Node) -> str:
    return f"{node.name} ({_target_name(node)}) in module '{module_of(node)}' at {_where(node)}"


def _lower_one(graph: fx.Graph, node: fx.Node, form: AttentionForm, spec: RingSpec, inside: str) -> LoweredAttention:
    group, cp, causal_default = spec.cp_group_name, spec.cp, spec.causal_default
    accumulate, comm, load_balance = spec.accumulate, spec.comm, spec.load_balance
    args = _bind(node, form)
    call = f"{form.name} '{node.name}' at {_where(node)}"
    if form.causal_default is not None:
        causal_default = form.causal_default
    causal = args.get(form.causal, causal_default if causal_default is not None else False)
    dropout_p = args.get("dropout_p", 0.0)
    for pname, value in ((form.causal, causal), ("dropout_p", dropout_p), ("window", args.get("window"))):
        if isinstance(value, fx.Node):
            raise RingAttentionError(f"{call}: {pname} is computed at run time, so the pass cannot "
                                     "tell which ring to build. Make it a Python constant.")
    if form is FLASH_ATTN:
        _check_flash_attn_extras(call, args)
    q, k, v = (args[p] for p in form.params[:3])
    q_shape, k_shape = _shape(q), _shape(k)
    heads = (2, 1) if form.seq_major else (1, 2)  # (head dim, sequence dim)
    q_heads = _int(q_shape, heads[0])
    kv_heads = _int(k_shape, heads[0])
    local_len = _int(q_shape, heads[1])
    documents = load_balance == "documents"
    if documents and args.get("seq_idx") is None:
        raise RingAttentionError(
            f"{call}: load_balance='documents' reorders every batch row so that each rank holds pieces of every "
            "document, and this attention call is not told the documents (seq_idx), so it would attend across "
            "them in the reordered sequence. Call gradsched.masks.attention(..., seq_idx=...) (gradsched.hf."
            "CausalLM does, given seq_idx), or use load_balance=True.")
    if documents:
        load_balance = True  # the reordered sequence is cut head-tail; seq_idx carries the documents
    window = effective_window(args.get("window"), local_len * cp if local_len is not None else None)
    masked = window is not None or any(args.get(m) is not None for m in form.masks if m != "window")
    choice = spec.check(call, q_heads=q_heads or 1, kv_heads=kv_heads or 1,
                        local_len=local_len if local_len is not None else 0, cp=cp,
                        causal=bool(causal), load_balance=load_balance, dropout_p=dropout_p,
                        has_attn_mask=args.get("attn_mask") is not None,
                        accumulate=accumulate, comm=comm, a2a_degree=spec.a2a_degree, masked=masked,
                        needs_lse=form.returns_lse,
                        head_dims=_head_dims(q, k, v))
    a2a_degree = spec.a2a_degree
    if choice is not None and q_heads is not None and kv_heads is not None:  # lower with what was chosen
        comm = choice.comm
        a2a_degree = choice.a2a if comm == "hybrid" else None

    with graph.inserting_before(node):
        if form.seq_major:
            q, k, v = (_transpose(graph, x) for x in (q, k, v))
        ring = graph.call_function(
            spec.attention, (q, k, v, group),
            {"causal": bool(causal), "scale": args.get(form.scale), "accumulate": accumulate,
             "comm": comm, "load_balance": load_balance, "return_lse": form.returns_lse,
             "call": call, **{m: args[m] for m in form.masks if args.get(m) is not None},
             **({"a2a_degree": a2a_degree} if a2a_degree is not None else {})})
        copy_meta(node, ring)
        result = ring
        if form.seq_major:
            ring.meta.pop("val", None)
            ring.meta.pop("example_value", None)
            set_fake(ring, fake_value(node).transpose(1, 2) if fake_value(node) is not None else None)
            result = _transpose(graph, ring)
            copy_meta(node, result)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return LoweredAttention(node.name, form.name, bool(causal), q_heads, kv_heads, _where(node), comm,
                            getattr(choice, "a2a", 1), getattr(choice, "why", ""), window, local_len,
                            "documents" if documents else load_balance, inside,
                            tuple(m for m in form.masks if m != "window" and args.get(m) is not None))


def _bind(node: fx.Node, form: AttentionForm) -> dict:
    """The call's arguments by parameter name (only those it passes)."""
    args = dict(zip(form.params, node.args))
    args.update(node.kwargs)
    return args


def _head_dims(q, k, v) -> tuple | None:
    """(query, key, value) head sizes (the last dimension in every form), where the shapes are known."""
    dims = tuple(_int(_shape(x), -1) for x in (q, k, v))
    return None if None in dims else dims


def _check_flash_attn_extras(call: str, args: dict) -> None:
    extras = {"window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None, "return_attn_probs": False}
    for name, neutral in extras.items():
        value = args.get(name, neutral)
        if isinstance(value, list):
            value = tuple(value)
        if value != neutral:
            raise RingAttentionError(f"{call}: {name}={value!r} is not supported by the ring, which "
                                     "computes only causal or full attention. Call it without "
                                     f"{name}, or keep this attention out of context parallelism.")


def _check_group(group: str, cp: int) -> None:
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return  # nothing to check against (e.g. inspecting graphs in one process)
    try:
        pg = dist.distributed_c10d._resolve_process_group(group)
    except (RuntimeError, ValueError):
        raise RingAttentionError(f"context-parallel lowering: no process group is named "
                                 f"{group!r}. Pass plan.process_group('cp').group_name.") from None
    size = dist.get_world_size(pg)
    if size != cp:
        raise RingAttentionError(f"context-parallel lowering: cp={cp}, but group {group!r} has "
                                 f"{size} ranks. Pass the CP group and its size.")


# ---- small helpers ------------------------------------------------------------------------

def _shape(node):
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _int(shape, dim):
    if shape is None:
        return None
    n = shape[dim]
    return n if isinstance(n, int) else None  # symbolic: the ring checks at run time


def _transpose(graph: fx.Graph, x: fx.Node) -> fx.Node:
    t = graph.call_function(torch.transpose, (x, 1, 2))
    val = fake_value(x)
    set_fake(t, val.transpose(1, 2) if isinstance(val, torch.Tensor) else None)
    return t


# gradsched's own source directory, found without importing the runtime (passes/ is gradsched/passes/ when
# installed, a sibling of gradsched/ in a checkout)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.basename(_PACKAGE_DIR) != "gradsched":
    _PACKAGE_DIR = os.path.join(_PACKAGE_DIR, "gradsched")


def _where(node: fx.Node) -> str:
    """The innermost frame of the call's stack outside gradsched (whose masks.attention and HF adapter
    wrap the user's or the model's attention layer), else the innermost."""
    frames = [frame for frame, _ in stack_frames(node.meta.get("stack_trace"))]
    theirs = [f for f in frames if f'"{_PACKAGE_DIR}{os.sep}' not in f]
    return (theirs or frames or ["<unknown source>"])[-1]


def _target_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", None) or str(node.target)


def _looks_like_attention(node: fx.Node) -> bool:
    name = _target_name(node) + " " + str(node.target)
    return any(other in name for other in _OTHER_ATTENTION)
