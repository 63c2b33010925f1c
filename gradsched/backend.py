"""The torch.compile backend "gradsched".

    torch.compile(model, backend="gradsched", options={"plan": plan, ...SyncOptions...})

Dynamo hands us the forward graph with parameters as inputs; AOTAutograd
splits it into forward and backward; the backward goes to the stage's GradSync,
which runs the pass pipeline (gradsched.passes) and compiles the result. With
`options["plan"].cp > 1`, attention is lowered into ring steps first.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from gradsched.sync import pass_pipeline
from gradsched.sync.compile import compile_graph
from gradsched.sync.replicas import make_tensors_equal
from gradsched.sync.owners import sync_of
from gradsched.options import SyncOptions
from gradsched.sync.watchdog import JOURNAL

_KEY = re.compile(r"\['([^']+)'\]|\.([A-Za-z_]\w*)")


def param_name_from_source(source_name: str) -> str:
    """L['self']._modules['layers']._modules['0']._parameters['weight'] -> layers.0.weight"""
    rest = source_name.split("]", 1)[1] if source_name.startswith("L[") else source_name
    parts = [a or b for a, b in _KEY.findall(rest)]
    return ".".join(p for p in parts if p not in ("_modules", "_parameters", "_buffers"))


def parameter_inputs(gm: fx.GraphModule, example_inputs) -> dict[int, tuple[str, torch.nn.Parameter]]:
    """Graph input index -> (parameter name, the Parameter) for every trainable parameter input."""
    found = {}
    for i, (ph, ex) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if isinstance(ex, torch.nn.Parameter) and ex.requires_grad:
            arg = ph.meta.get("grapharg")
            found[i] = (param_name_from_source(arg.source.name) if arg is not None else ph.name, ex)
    return found


def _local_sequence_length(example_inputs) -> int | None:
    """S_local of the token input ([B, S_local] integers), the dimension context parallelism splits."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.dtype.is_floating_point:
            return int(x.shape[1])
    return None


def _received_sequence_length(example_inputs) -> int | None:
    """A later pipeline stage's S: dimension 1 of its received activation ([B, S, ...] floating, needing a
    gradient), where the stage has no token input."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.is_floating_point() and x.requires_grad \
                and not isinstance(x, torch.nn.Parameter):
            return int(x.shape[1])
    return None


def lower_attention(gm: fx.GraphModule, example_inputs, plan, opts):
    """Context parallelism: attention becomes ring steps over the plan's CP group (the pass pipeline's
    entries for Dynamo's graph); anything left mixing tokens on a rank's slice is refused."""
    from gradsched.cp import ring_attention as ring
    from gradsched.passes.context_parallel import RingSpec
    ring_spec = RingSpec(plan.process_group("cp").group_name, plan.cp, attention=ring.ring_attention,
                         check=ring.check_attention_call, accumulate=opts.accumulate, comm=opts.comm,
                         load_balance=opts.load_balance, a2a_degree=opts.a2a_degree)
    seq_len = _local_sequence_length(example_inputs)
    records = pass_pipeline.run("dynamo", gm, pass_pipeline.Conditions.of(opts, cp=plan.cp), {
        "lower_attention_to_ring": ring_spec,
        "unlowered_attention": pass_pipeline.Later(lambda r: (r["lower_attention_to_ring"], seq_len))})
    local = records["unlowered_attention"]
    if local:
        raise NotImplementedError(
            f"context parallelism (cp={plan.cp}) cannot lower this attention, and left local to each rank's "
            f"slice of the sequence it would be silently wrong: {'; '.join(local)}. Express it with "
            "torch.nn.functional.scaled_dot_product_attention (a Hugging Face model: attn_implementation='sdpa', "
            "or gradsched.hf.CausalLM), or train this model with cp=1.")
    return records["lower_attention_to_ring"]


def _sync_for_backend_by_name(plan, options: dict, params):
    """The GradSync of torch.compile(model, backend="gradsched", options=...): one per model, reused
    by recompiles. Alone, the backend sees single backward passes, so it takes only what it can
    run right: one stage, every backward ending a step, the reductions inside it."""
    from gradsched.sync.runtime import GradSync
    from gradsched.sync.stage_setup import setup_stage
    if plan is None:
        raise ValueError('backend="gradsched" needs options={"plan": gradsched.ParallelPlan.from_world(...)} '
                         "(or use gradsched.parallelize).")
    opts = SyncOptions.from_dict(options)
    refuse = []
    if plan.pp > 1:
        refuse.append(f"pp={plan.pp}: pipeline stages need a schedule")
    if plan.cp > 1:
        refuse.append(f"cp={plan.cp}: context parallelism shards the sequence, its positions and the loss")
    if opts.microbatches > 1:
        refuse.append(f"microbatches={opts.microbatches}: only a driver knows which backward ends a step")
    if opts.placement == "flush":
        refuse.append("placement='flush': nothing would call the flush")
    if plan.tp > 1:
        refuse.append(f"tp={plan.tp}: each rank trains its shards of the layers, which only a ParallelModel keeps, "
                      "gathers (state_dict, checkpoints) and steps")
    if opts.shard == "params":
        refuse.append("shard='params': the model's own parameters would be left without storage, and only a "
                      "ParallelModel reads them back whole (state_dict, checkpoints)")
    if refuse:
        raise ValueError("torch.compile(backend=\"gradsched\") alone cannot run " + "; ".join(refuse) +
                         ". Use gradsched.parallelize(model, plan=..., loss_fn=..., ...) and its train_step, "
                         "which runs the schedule, the micro-batches and the loss for you.")
    setup, existing = setup_stage(plan, opts), sync_of(params)
    if existing is not None and existing.setup == setup and existing.options == opts:
        return existing  # a recompile of the same model
    return GradSync(setup, opts)


def _param_placeholders(fw_gm: fx.GraphModule, params: dict) -> dict[str, str]:
    """Forward-graph placeholder name -> parameter name: AOTAutograd's forward takes Dynamo's inputs in
    order (primals_1, primals_2, ...)."""
    phs = fw_gm.graph.find_nodes(op="placeholder")
    out = {}
    for i, (name, p) in params.items():
        v = phs[i].meta.get("val") if i < len(phs) else None
        if v is None or tuple(v.shape) != tuple(p.shape) or v.dtype != p.dtype:
            raise RuntimeError(f"gradsched shard='params': the forward graph's input {i} is not parameter {name} "
                               f"{tuple(p.shape)} as expected (AOTAutograd reordered its inputs?).")
        out[phs[i].name] = name
    return out


def _module_tensors(gm: fx.GraphModule, example_inputs) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of the graph's parameter and buffer inputs (Dynamo lifts each tensor once)."""
    out = []
    for ph, ex in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        arg = ph.meta.get("grapharg")
        source = arg.source.name if arg is not None else ""
        kind = "parameter" if isinstance(ex, torch.nn.Parameter) else "buffer" if "_buffers[" in source else ""
        if kind:
            out.append((kind, param_name_from_source(source) if source else ph.name, ex))
    return out


def _refuse_meta(params: dict) -> None:
    """By name nothing allocates a meta-built model (parallelize does, per stage; the dry run keeps it on meta)."""
    meta = [name for name, p in params.values() if p.is_meta]
    if meta:
        raise ValueError(f"gradsched: parameter {meta[0]} (and {len(meta) - 1} more) is on the meta device, with no "
                         "values to train. Build the model on meta and pass it to gradsched.parallelize(..., "
                         "init_weights=fn), which allocates each rank's stage; or build it on a real device.")


def plan_roles(gm: fx.GraphModule, params: dict, tp_plan: dict | None) -> tuple:
    """The gradsched option tp_plan ({module-name pattern: role}) as the pass takes it: (placeholder name, role) of
    each parameter input whose module's name a pattern matches (the first that does)."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    out = []
    for i, (name, _) in params.items():
        module = name.rsplit(".", 1)[0]
        role = next((r for pattern, r in (tp_plan or {}).items() if fnmatch.fnmatchcase(module, pattern)), None)
        if role is not None:
            out.append((phs[i].name, role))
    return tuple(out)


def tensor_parallel_shards(gm: fx.GraphModule, example_inputs, plan, params: dict, tp_shards, vocab_outputs=None,
                           tp_plan: dict | None = None):
    """tp > 1: Dynamo's graph split for this TP rank (passes/tensor_parallel.py), in place. Returns {input index:
    this rank's shard} of the TP-sharded parameter inputs, cut once a model (gradsched.tp.local_shards).
    vocab_outputs (a list, for a last pipeline stage whose loss runs loss-parallel after it): its logits are left
    split over the vocabulary, and the dimension they are split along appended."""
    from gradsched.tp.local_graph import shard_graph, tensor_parallel_spec
    spec = tensor_parallel_spec(plan, _local_sequence_length(example_inputs) or _received_sequence_length(example_inputs))
    spec = dataclasses.replace(spec, vocab_output=vocab_outputs is not None, roles=plan_roles(gm, params, tp_plan))
    name = lambda i: params[i][0] if i in params else f"graph input {i}"  # noqa: E731
    record, _, shards = shard_graph(gm, example_inputs, spec, lambda i, whole, p: tp_shards.shard(whole, p, name(i)))
    if record.vocab_output is not None:
        vocab_outputs.append(record.vocab_output)
    return shards


def _static(shard: torch.Tensor) -> torch.Tensor:
    """A shard as AOTAutograd's example input: fake in Dynamo's fake mode with static sizes (it is no input Dynamo
    traced, so a symbol for its sizes would have no source to guard on)."""
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    return ctx.fake_mode.from_tensor(shard, static_shapes=True) if ctx is not None and ctx.fake_mode else shard


def gradsched_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, grad_sync=None,
                      plan=None, tp_shards=None, vocab_outputs=None):
    """Dynamo backend entry point (registered as "gradsched"). By name, the plan and the options come
    in `options`; gradsched.parallelize passes its plan, the stage's GradSync and, under tp > 1, the model's TP
    shards (gradsched.tp.local_shards) and, for a last pipeline stage, the list its vocab-parallel logits' dimension
    goes to (tensor_parallel_shards). Compiling is a journal entry of kind "compile": peers waiting meanwhile
    give it compile_timeout_s, not fault_timeout_s."""
    with JOURNAL.entry("compiling a graph (Dynamo's graph: AOTAutograd, gradsched's passes, Inductor)", "compile"):
        return _compile(gm, example_inputs, options, grad_sync, plan, tp_shards, vocab_outputs)


def _compile(gm, example_inputs, options, grad_sync, plan, tp_shards, vocab_outputs):
    options = dict(options or {})
    plan = options.pop("plan", plan)
    params = parameter_inputs(gm, example_inputs)
    if grad_sync is None:
        _refuse_meta(params)
        found = [p for _, p in params.values()]
        grad_sync = _sync_for_backend_by_name(plan, options, found)
        if sync_of(found) is not grad_sync:  # the model's first compile, on every rank: its replicas start equal
            make_tensors_equal(_module_tensors(gm, example_inputs), plan)
    opts = grad_sync.options
    compiler = opts.compiler
    swap = {}  # tp > 1: input index -> this TP rank's shard, passed in place of the whole parameter
    if plan.tp > 1:
        swap = tensor_parallel_shards(gm, example_inputs, plan, params, tp_shards, vocab_outputs, opts.tp_plan)
        example_inputs = [_static(swap[i]) if i in swap else x for i, x in enumerate(example_inputs)]
        params = {i: (n, swap.get(i, p)) for i, (n, p) in params.items()}
    tp_sharded = frozenset(params[i][0] for i in swap if i in params)
    if plan.cp > 1:
        grad_sync.attention_reports.append(lower_attention(gm, example_inputs, plan, opts))

    names = {}  # shard="params": this call's forward placeholder -> parameter name, for its backward

    def bw_compiler(bw_gm: fx.GraphModule, bw_inputs):
        with JOURNAL.entry("compiling the backward graph", "compile"):
            return _bw_compiler(bw_gm, bw_inputs)

    def _bw_compiler(bw_gm: fx.GraphModule, bw_inputs):
        descs = bw_gm.graph.output_node().meta.get("desc") or []
        grad_names = {}
        for out_idx, desc in enumerate(descs):
            of = getattr(desc, "grad_of", None)
            idx = getattr(of, "idx", None)
            if idx in params:
                grad_names[out_idx] = params[idx][0]
        return grad_sync.register_backward(bw_gm, bw_inputs, grad_names, {n: p for n, p in params.values()}, names,
                                           tp_sharded)

    def fw_compiler(fw_gm: fx.GraphModule, fw_inputs):
        if opts.shard == "params":
            names.update(_param_placeholders(fw_gm, params))
            return grad_sync.register_forward(fw_gm, fw_inputs, names, {n: p for n, p in params.values()})
        fn = compile_graph(fw_gm, fw_inputs, compiler,
                           agree=f"the forward graph of stage {grad_sync.setup.stage}" if opts.check_ranks else None)
        if not opts.shard:
            return fn

        def after_the_gather(args):  # shard=True: the optimizer's last all-gather lands before its parameters are read
            grad_sync.finish_param_gather()
            return fn(args)
        after_the_gather._boxed_call = True
        return after_the_gather

    from torch._inductor.decomposition import select_decomp_table
    compiled = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, decompositions=select_decomp_table(),
                            partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)
    if not swap:
        return compiled

    def with_shards(*args):  # Dynamo passes the model's (released) whole parameters
        return compiled(*[swap.get(i, a) for i, a in enumerate(args)])
    return with_shards
