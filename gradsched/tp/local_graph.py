"""One TP rank's graph of a model: the tensor-parallel pass on Dynamo's graph, compiled over this rank's
parameter shards, its backward proved before it is compiled.

Dynamo traces the model as one process holds it and calls the compiled graph with the model's own
(whole) parameters; the pass rewrites the graph to take each TP-sharded parameter's local shard
instead, and the callable returned here passes those shards in their place. The shards are new
leaf Parameters: their gradients are this rank's, whole for its part. A replicated parameter is
passed as it is, its gradient summed over TP inside the backward (see passes/tensor_parallel.py),
which passes/verify_tensor_parallel.py proves of the backward graph AOTAutograd derives.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from gradsched.passes.tensor_parallel import TensorParallelSpec
from gradsched.passes.verify_tensor_parallel import TensorParallelGradSpec
from gradsched.sync import pass_pipeline
from gradsched.tp import collectives
from gradsched.tp.loss_parallel import vocab_parallel_cross_entropy
from gradsched.tp.local_shards import local_shard


def tensor_parallel_spec(plan, seq_len: int, loss_parallel: bool = True) -> TensorParallelSpec:
    """The pass's spec over the plan's TP group, with this runtime's collectives (and its vocab-parallel
    cross-entropy for a loss in the graph, unless loss_parallel=False: then the logits are gathered)."""
    return TensorParallelSpec(plan.tp, plan.index("tp"), plan.process_group("tp").group_name, seq_len,
                              collectives.gather_sequence, collectives.scatter_sequence, collectives.grad_sum,
                              collectives.gather_output, vocab_parallel_cross_entropy if loss_parallel else None,
                              collectives.scatter_input)


@dataclass
class LocalGraph:
    forward: Callable  # takes Dynamo's arguments (whole parameters), runs this rank's graph
    record: object  # the pass's TensorParallelRecord
    shards: dict  # graph input index -> this rank's shard (a leaf Parameter) of that parameter
    partitions: dict  # graph input index -> its parameter's Partition (every parameter input)
    proofs: list = field(default_factory=list)  # the verifier's proof of each backward graph
    buckets: list = field(default_factory=list)  # passes/tp_grad_buckets' record of each backward graph
    backward_graphs: list = field(default_factory=list)  # a copy of each, as AOTAutograd derived it
    forward_graphs: list = field(default_factory=list)  # a copy of each forward graph AOTAutograd made


def shard_graph(gm: fx.GraphModule, example_inputs, spec: TensorParallelSpec, cut: Callable):
    """The pass on `gm` (in place), and each graph input's partition and shard: returns (the pass's record,
    {input index: Partition} of every parameter input, {input index: shard} of the TP-sharded ones, each from
    `cut(index, whole value, partition)`)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    record = pass_pipeline.run("dynamo", gm, pass_pipeline.Conditions(tp=spec.tp),
                               {"torch_level": None, "shard_for_tensor_parallel": spec})["shard_for_tensor_parallel"]
    partitions, shards = {}, {}
    for i, (ph, value) in enumerate(zip(placeholders, example_inputs)):
        p = record.partitions.get(ph.name)
        if p is None:
            continue
        partitions[i] = p
        if p.dim is not None:
            shards[i] = cut(i, value, p)
    return record, partitions, shards


def compile_local(gm: fx.GraphModule, example_inputs, spec: TensorParallelSpec, inner: Callable,
                  names: dict | None = None) -> LocalGraph:
    """Rewrite `gm` for this TP rank and compile it through AOTAutograd, each graph with `inner(gm,
    example inputs)` (Inductor's compile_fx_inner, or a boxed eager call); the shards are cut from the
    example inputs, which are the model's parameters (`names`: input index -> parameter name, for the
    verifier's messages). The backward graph is refused (TensorParallelHazard) unless proved."""
    from torch._inductor.decomposition import select_decomp_table
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    record, partitions, shards = shard_graph(gm, example_inputs, spec, lambda i, value, p: torch.nn.Parameter(
        local_shard(value, p, spec.tp, spec.rank), requires_grad=value.requires_grad))
    names = dict(names or {})
    for i in partitions:
        names.setdefault(i, placeholders[i].name)
    local = LocalGraph(None, record, shards, partitions)

    def backward(bw_gm: fx.GraphModule, bw_inputs):
        grads = {}
        for out, desc in enumerate(bw_gm.graph.output_node().meta.get("desc") or []):
            i = getattr(getattr(desc, "grad_of", None), "idx", None)
            if i in partitions:
                grads[out] = (names[i], partitions[i].dim is None)
        local.backward_graphs.append(copy.deepcopy(bw_gm))
        if not partitions:  # a graph of no parameter (a loss after the last stage): no gradient to prove
            return inner(bw_gm, bw_inputs)
        grad_spec = TensorParallelGradSpec(spec.group, grads)
        records = pass_pipeline.run("backward", bw_gm, pass_pipeline.Conditions(tp=spec.tp), {
            "bucket_tp_grad_sums": grad_spec, "grad_ready_order": {o: n for o, (n, _) in grads.items()},
            "verify_tensor_parallel": grad_spec})
        proof = records["verify_tensor_parallel"]
        local.buckets.append(records["bucket_tp_grad_sums"])
        local.proofs.append(proof)
        proof.raise_if_unsafe()
        return inner(bw_gm, bw_inputs)

    def forward_graph(fw_gm: fx.GraphModule, fw_inputs):
        local.forward_graphs.append(copy.deepcopy(fw_gm))
        return inner(fw_gm, fw_inputs)

    compiled = aot_autograd(fw_compiler=forward_graph, bw_compiler=backward, decompositions=select_decomp_table(),
                            partition_fn=min_cut_rematerialization_partition)(
        gm, [shards.get(i, x) for i, x in enumerate(example_inputs)])

    def forward(*args):
        return compiled(*[shards.get(i, a) for i, a in enumerate(args)])
    local.forward = forward
    return local


def collective_bytes(graphs, tp: int) -> int:
    """Bytes a rank sends over the TP group in one run of `graphs` (forward and backward), as a ring moves
    them: (tp-1)/tp of the whole buffer for an all-gather or a reduce-scatter, twice that for an all-reduce."""
    c10d = torch.ops._c10d_functional
    total = 0.0
    for gm in graphs:
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.target is c10d.all_gather_into_tensor.default:
                total += (tp - 1) / tp * v.numel() * v.element_size()
            elif n.target is c10d.reduce_scatter_tensor.default:
                x = n.args[0].meta["val"]
                total += (tp - 1) / tp * x.numel() * x.element_size()
            elif n.target is c10d.all_reduce.default:
                total += 2 * (tp - 1) / tp * v.numel() * v.element_size()
    return round(total)
