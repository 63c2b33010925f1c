"""Spell a pipeline stage's aten-level ops as the torch-level calls the tensor-parallel pass reads.

A pipeline stage is a GraphModule that torch.distributed.pipelining's export traced: Dynamo's graph of it
calls `aten.linear.default`, `aten.embedding.default`, `aten.view.default` and so on, where Dynamo's graph of
the unsplit model calls `F.linear`, `F.embedding`, `x.view`. This pass rewrites each aten call it knows into
the same computation spelled as the torch-level call (argument order and defaults mapped), so the roles
(passes/tp_roles.py) and the rewrite (passes/tensor_parallel.py) see one vocabulary. Export's metadata
assertions (`aten._assert_tensor_metadata`, written for a `.to(dtype)`) have no torch-level spelling and no
users: they are dropped, as Dynamo's graph never holds them (and a shard's sizes are not the traced ones);
`aten.alias` (a view of the whole tensor, which export writes where a stage returns its input) is its input.
A fused attention kernel (flash, memory-efficient, CPU flash) whose output alone is read becomes a function of
SDPA's arguments running that kernel (FUSED_ATTENTION), split by heads as SDPA is.

Invariant: every rewritten node computes what it computed (same op, same arguments, its meta kept, so its
`example_value` stays right); a call it does not know is left as it is, and the tensor-parallel pass refuses
it by name if it reaches a split value.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _binary(fn, alpha_ok=False):
    def spell(args, kwargs):
        if alpha_ok and kwargs.get("alpha", 1) != 1:
            return None
        return "call_function", fn, tuple(args[:2]), {}
    return spell


def _unary(fn):
    return lambda args, kwargs: ("call_function", fn, (args[0],), {})


def _embedding(args, kwargs):
    w, ids = args[0], args[1]
    padding = _arg(args, kwargs, 2, "padding_idx", -1)
    scale = _arg(args, kwargs, 3, "scale_grad_by_freq", False)
    sparse = _arg(args, kwargs, 4, "sparse", False)
    # F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse), as Dynamo spells it
    return "call_function", F.embedding, (ids, w, None if padding == -1 else padding, None, 2.0, scale, sparse), {}


def _layer_norm(args, kwargs):
    x, shape = args[0], args[1]
    return "call_function", F.layer_norm, (x, shape, _arg(args, kwargs, 2, "weight", None),
                                           _arg(args, kwargs, 3, "bias", None), _arg(args, kwargs, 4, "eps", 1e-5)), {}


def _rms_norm(args, kwargs):
    return "call_function", F.rms_norm, (args[0], args[1], _arg(args, kwargs, 2, "weight", None),
                                         _arg(args, kwargs, 3, "eps", None)), {}


def _cross_entropy(args, kwargs):
    return "call_function", F.cross_entropy, (args[0], args[1]), {
        "weight": _arg(args, kwargs, 2, "weight", None),
        "reduction": _REDUCTION[_arg(args, kwargs, 3, "reduction", 1)],
        "ignore_index": _arg(args, kwargs, 4, "ignore_index", -100),
        "label_smoothing": _arg(args, kwargs, 5, "label_smoothing", 0.0)}


def _dims_method(name):
    def spell(args, kwargs):
        dims = _arg(args, kwargs, 1, "dim", None)
        keep = _arg(args, kwargs, 2, "keepdim", False)
        if kwargs.get("dtype") is not None:
            return None
        return "call_method", name, (args[0], dims, keep), {}
    return spell


def _slice(args, kwargs):
    dim, start = _arg(args, kwargs, 1, "dim", 0), _arg(args, kwargs, 2, "start", None)
    end, step = _arg(args, kwargs, 3, "end", None), _arg(args, kwargs, 4, "step", 1)
    if not isinstance(dim, int) or dim < 0:  # a negative dim would need the rank: x[..., a:b] from the right
        return None
    # x[:, :, a:b] as Dynamo spells it: operator.getitem with a tuple of slices
    return "call_function", operator.getitem, (args[0], (slice(None),) * dim + (slice(start, end, step),)), {}


def _to_copy(args, kwargs):
    if set(kwargs) - {"dtype", "layout", "device"} or len(args) > 1:
        return None
    return "call_method", "to", (args[0],), {"dtype": kwargs["dtype"]} if "dtype" in kwargs else {}


SPELLINGS = {
    aten.linear.default: lambda a, k: ("call_function", F.linear, (a[0], a[1], _arg(a, k, 2, "bias", None)), {}),
    aten.embedding.default: _embedding,
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _rms_norm,
    aten.scaled_dot_product_attention.default: lambda a, k: (
        "call_function", F.scaled_dot_product_attention, tuple(a), dict(k)),
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.gelu.default: lambda a, k: ("call_function", F.gelu, (a[0],), {"approximate": k.get("approximate", "none")}),
    aten.dropout.default: lambda a, k: ("call_function", F.dropout, (a[0], a[1], a[2]), {}) if len(a) == 3 and not k
    else None,
    aten.silu.default: _unary(F.silu),
    aten.relu.default: _unary(F.relu),
    aten.tanh.default: _unary(torch.tanh),
    aten.sigmoid.default: _unary(torch.sigmoid),
    aten.exp.default: _unary(torch.exp),
    aten.rsqrt.default: _unary(torch.rsqrt),
    aten.sqrt.default: _unary(torch.sqrt),
    aten.neg.default: _unary(operator.neg),
    aten.erf.default: _unary(torch.erf),
    aten.add.Tensor: _binary(operator.add, alpha_ok=True),
    aten.sub.Tensor: _binary(operator.sub, alpha_ok=True),
    aten.mul.Tensor: _binary(operator.mul),
    aten.div.Tensor: _binary(operator.truediv),
    aten.pow.Tensor_Scalar: _binary(operator.pow),
    aten.transpose.int: lambda a, k: ("call_function", torch.transpose, tuple(a[:3]), {}),
    aten.view.default: lambda a, k: ("call_method", "view", (a[0], a[1]), {}),
    aten.reshape.default: lambda a, k: ("call_function", torch.reshape, (a[0], a[1]), {}),
    aten.unsqueeze.default: lambda a, k: ("call_method", "unsqueeze", (a[0], a[1]), {}),
    aten.expand.default: lambda a, k: ("call_method", "expand", (a[0], a[1]), {}) if not k else None,
    aten.split.Tensor: lambda a, k: ("call_function", torch.split, (a[0], a[1], _arg(a, k, 2, "dim", 0)), {}),
    aten.split_with_sizes.default: lambda a, k: ("call_function", torch.split,
                                                 (a[0], list(a[1]), _arg(a, k, 2, "dim", 0)), {}),
    aten.cat.default: lambda a, k: ("call_function", torch.cat, (list(a[0]), _arg(a, k, 1, "dim", 0)), {}),
    aten.mean.dim: _dims_method("mean"),
    aten.sum.dim_IntList: _dims_method("sum"),
    aten.softmax.int: lambda a, k: ("call_function", torch.softmax, (a[0], a[1]), {}) if len(a) < 3 and not k
    else None,
    aten.slice.Tensor: _slice,
    aten._to_copy.default: _to_copy,
    aten.to.dtype: lambda a, k: ("call_method", "to", (a[0], a[1]), {}) if len(a) == 2 and not k else None,
    # a clone's memory format changes strides, not values (export writes x.contiguous() so)
    aten.clone.default: lambda a, k: ("call_method", "clone", (a[0],), {}) if set(k) <= {"memory_format"} else None,
    aten.contiguous.default: lambda a, k: ("call_method", "contiguous", (a[0],), {}) if not k and len(a) == 1
    else None,
    aten.addmm.default: lambda a, k: ("call_function", torch.addmm, tuple(a[:3]), {}) if len(a) == 3 and not k
    else None,
    aten.permute.default: lambda a, k: ("call_method", "permute", (a[0], *a[1]), {}),
}


# The fused attention kernels SDPA dispatches to (a graph traced on meta holds them where the caller chose the
# kernel, as the dry run does to price a device): spelled as a function of SDPA's arguments that runs the same
# kernel and returns its output, which the tensor-parallel pass splits by heads as it splits SDPA.
def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]


def efficient_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, compute_log_sumexp=True):
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, compute_log_sumexp, dropout_p, is_causal,
                                                        scale=scale)[0]


def cpu_flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                                            scale=scale)[0]


for _fn in (flash_attention, efficient_attention, cpu_flash_attention):
    _fn.computes_sdpa = True  # passes/tp_roles.is_sdpa

FUSED_ATTENTION = {
    aten._scaled_dot_product_flash_attention.default: lambda a, k: (
        flash_attention, (*a[:3],), {"dropout_p": _arg(a, k, 3, "dropout_p", 0.0),
                                     "is_causal": _arg(a, k, 4, "is_causal", False), "scale": k.get("scale")})
    if not _arg(a, k, 5, "return_debug_mask", False) else None,
    aten._scaled_dot_product_efficient_attention.default: lambda a, k: (
        efficient_attention, (*a[:3], a[3]), {"compute_log_sumexp": a[4], "dropout_p": _arg(a, k, 5, "dropout_p", 0.0),
                                              "is_causal": _arg(a, k, 6, "is_causal", False), "scale": k.get("scale")}),
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda a, k: (
        cpu_flash_attention, (*a[:3], k.get("attn_mask")), {"dropout_p": _arg(a, k, 3, "dropout_p", 0.0),
                                                          "is_causal": _arg(a, k, 4, "is_causal", False),
                                                          "scale": k.get("scale")}),
}


def _fused_attention(n: fx.Node) -> bool:
    """A fused kernel whose output alone is read, respelled in place (see FUSED_ATTENTION)."""
    spell = FUSED_ATTENTION.get(n.target)
    users = list(n.users)  # a traced body may take every piece of the tuple, reading only the first
    if spell is None or not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in users):
        return False
    new = spell(list(n.args), dict(n.kwargs))
    if new is None:
        return False
    n.target, n.args, n.kwargs = new
    for key in ("val", "example_value"):
        if isinstance(n.meta.get(key), (tuple, list)):
            n.meta[key] = n.meta[key][0]
    for u in users:
        if u.args[1] == 0:
            u.replace_all_uses_with(n)
        n.graph.erase_node(u)
    return True


def torch_level(gm: fx.GraphModule, spec=None):
    """The pass (see the module docstring): (gm rewritten in place, how many calls were respelled), the bodies
    of its higher-order ops (an activation-checkpointed layer's) included."""
    count = sum(_respell(m) for m in gm.modules() if isinstance(m, fx.GraphModule))
    return gm, count


def _respell(gm: fx.GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default and not n.users:
            gm.graph.erase_node(n)
            count += 1
            continue
        if n.op == "call_function" and n.target is aten.alias.default:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
            count += 1
            continue
        if n.op == "call_function" and _fused_attention(n):
            count += 1
            continue
        spell = SPELLINGS.get(n.target) if n.op == "call_function" else None
        new = spell(list(n.args), dict(n.kwargs)) if spell else None
        if new is None:
            continue
        n.op, n.target, n.args, n.kwargs = new
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
