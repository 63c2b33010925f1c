"""Build one stage's gradient sync at compile time: plan, passes, compiled graphs.

    build_stage(bw_gm, ...)        from the stage's AOT backward graph: the pass pipeline's entries for the
                                   backward graph (gradsched.sync.pass_pipeline), the compile-time refusals
                                   (gradsched.sync.preflight), the SyncPlan (plan_sync: buckets and which
                                   graph reduces each), the sync graphs (gradsched.sync.sync_graphs), and
                                   the graphs compiled: the plain backward for the micro-batches before the
                                   last, whole or, under a zero-bubble schedule, cut in B and W

    several stages a rank: gradsched.sync.rank_stages (build_part, build_union), with this module's
    graphs

Returns a BuiltStage: plain data and compiled callables, which the executor
(gradsched.sync.runtime.GradSync) runs and nothing else builds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from gradsched.passes.bucketing import BucketLayout
from gradsched.passes.grad_sync import SyncRecord
from gradsched.passes.cut_backward import CutRecord, CutSpec
from gradsched.passes.verify_tensor_parallel import TensorParallelGradSpec

from gradsched.sync import pass_pipeline

from gradsched.sync.compile import compile_graph
from gradsched.options import SyncOptions
from gradsched.sync.param_shards import ParamShards, shard_more, shard_parameters
from gradsched.sync.preflight import check_backward_graph
from gradsched.sync.stage_setup import StageSetup
from gradsched.sync.sync_graphs import backward_sync_graph, flush_sync_graph
from gradsched.sync.sync_plan import SyncPlan, plan_sync


@dataclass
class Halves:
    """A backward graph cut in B and W (passes/cut_backward.py), each half compiled (boxed callables)."""
    record: CutRecord
    b: object
    w: object


@dataclass
class SyncGraph:
    """One compiled graph reducing some of a stage's buckets."""
    where: str  # "backward" (the last micro-batch's backward graph), "flush", or "early{j}" (returns in flight)
    layout: BucketLayout  # the buckets it reduces, with their indices in the stage's layout
    gm: fx.GraphModule  # the graph gradsched built and verifies (Inductor compiles a copy)
    record: SyncRecord  # how to feed it and read its results
    fn: object  # boxed callable
    inputs: tuple = ()  # flush graph: the gradients it takes, in order
    halves: Halves | None = None  # backward graph under a zero-bubble schedule: B and W, run in place of fn

    @property
    def code(self) -> str | None:
        """Inductor's output code for this graph (None under compiler='eager'); B's then W's when cut."""
        if self.halves is not None:
            codes = [getattr(f, "source_code", None) for f in (self.halves.b, self.halves.w)]
            return None if None in codes else "\n".join(codes)
        return getattr(self.fn, "source_code", None)


@dataclass
class BuiltStage:
    plan: SyncPlan
    params: dict  # name -> the stage's trained Parameter
    plain: object  # the unchanged backward, compiled (micro-batches before the last)
    graphs: dict  # "backward" and/or "flush" -> SyncGraph, as the plan places buckets
    param_inputs: tuple = ()  # shard="params": the buckets whose shards the backward graphs take, appended
    plain_halves: Halves | None = None  # under a zero-bubble schedule: the plain backward as B and W
    grad_names: dict | None = None  # backward output position -> parameter name
    order: tuple = ()  # several stages a rank: the parts in the order they finish a step (early graphs), or ()
    tp_sharded: frozenset = frozenset()  # tp > 1: the names whose Parameters are this rank's TP shards
    tp_proof: object = None  # tp > 1: passes/verify_tensor_parallel's proof of the backward graph


def backward_specs(setup: StageSetup, options: SyncOptions, grad_names: dict[int, str], zero_bubble: bool,
                   tp_sharded: frozenset):
    """The backward passes' conditions and specs: the ready order, and under tp > 1 the TP proof's (each
    gradient with whether its parameter is whole on every TP rank, so summed over TP once)."""
    tp = len(setup.tp_group.ranks) if setup.tp_group is not None else 1
    conditions = pass_pipeline.Conditions.of(options, zero_bubble=zero_bubble, tp=tp)
    specs = {"grad_ready_order": grad_names}
    if tp > 1:
        specs["verify_tensor_parallel"] = specs["bucket_tp_grad_sums"] = TensorParallelGradSpec(
            setup.tp_group.name, {i: (n, n not in tp_sharded) for i, n in grad_names.items()})
    return conditions, specs


def build_stage(bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str],
                params: dict[str, torch.nn.Parameter], setup: StageSetup, options: SyncOptions,
                first: BuiltStage | None = None, shards: ParamShards | None = None,
                param_names: dict | None = None, zero_bubble: bool = False,
                tp_sharded: frozenset = frozenset()) -> BuiltStage:
    """`grad_names`: backward output index -> parameter name; `first`: the stage's earlier build
    (a recompile must train the same parameters); `shards`: where the parameters live (shard="params"),
    `param_names`: this backward's forward graph's placeholder -> parameter name (the backward's saved
    inputs keep the forward's names; they mean other parameters in another graph); `tp_sharded`: under tp > 1,
    the names whose gradients are TP shards (the others' are proved summed over TP once)."""
    conditions, specs = backward_specs(setup, options, grad_names, zero_bubble, tp_sharded)
    tp = conditions.tp
    # under shard="params" with resharding, the backward gathers what it reads again
    bw_gm, records, param_inputs, example_inputs = run_passes("backward", bw_gm, example_inputs, setup, conditions,
                                                              specs, shards, param_names)
    if tp > 1:
        records["verify_tensor_parallel"].raise_if_unsafe()
    ready = records["grad_ready_order"]
    check_backward_graph(setup, ready, list(first.plan.ready) if first else None)
    if shards is not None:
        check_sharded(ready, shards)
    plan = plan_sync(ready, options, stage=setup.stage, rank=setup.rank, placement=setup.placement,
                     grad_group=setup.grad_group, tie_groups=setup.tie_groups,
                     ties={n: t.key for n, t in setup.ties.items()},
                     param_dtypes={n: p.dtype for n, p in params.items()},
                     layout=shards.layout if shards is not None else None,
                     every_rank=set(setup.grad_group.ranks) == set(setup.all_ranks.ranks))
    graphs = {}
    if "backward" in plan.graphs:
        graphs["backward"] = _backward_graph(bw_gm, example_inputs, plan, params, options, zero_bubble)
    if "flush" in plan.graphs:
        graphs["flush"] = flush_graph(plan, params, options)
    what = f"the backward graph of stage {setup.stage} (a micro-batch before the last)"
    if pass_pipeline.applies("cut", "cut_backward", conditions):
        plain_halves = cut_graph(bw_gm, example_inputs, set(grad_names), options, what)
        return BuiltStage(plan, params, None, graphs, param_inputs, plain_halves, dict(grad_names),
                          tp_sharded=frozenset(tp_sharded), tp_proof=records.get("verify_tensor_parallel"))
    plain = compile_graph(bw_gm, example_inputs, options.compiler, agree=agreement_name(options, what))
    return BuiltStage(plan, params, plain, graphs, param_inputs, grad_names=dict(grad_names),
                      tp_sharded=frozenset(tp_sharded), tp_proof=records.get("verify_tensor_parallel"))


def cut_graph(gm: fx.GraphModule, example_inputs, weight_outputs: set, options: SyncOptions, what: str,
         comm_overlap: bool = False) -> Halves:
    """gm cut in B and W, each compiled; W's example inputs are the stash's values (node.meta["val"], in the
    backward's fake mode) and the inputs it reads."""
    rec = pass_pipeline.run("cut", gm, pass_pipeline.Conditions(zero_bubble=True),
                            {"cut_backward": CutSpec(frozenset(weight_outputs))})["cut_backward"]
    b_examples = [example_inputs[i] for i in rec.b_inputs]
    stash = [n.meta["val"] for n in rec.w.graph.find_nodes(op="placeholder")][:len(rec.stash)]
    w_examples = stash + [example_inputs[i] for i in rec.w_inputs]
    b = compile_graph(rec.b, b_examples, options.compiler, comm_overlap,
                      agree=agreement_name(options, f"{what}, its inputs' gradients (B)"))
    w = compile_graph(rec.w, w_examples, options.compiler, comm_overlap,
                      agree=agreement_name(options, f"{what}, its weights' gradients (W)"))
    return Halves(rec, b, w)


def build_forward(fw_gm: fx.GraphModule, example_inputs, names: dict, params: dict, setup: StageSetup,
                  options: SyncOptions, shards: ParamShards | None, several: bool = False):
    """shard="params": the stage's forward graph, gathering each bucket's parameters before use
    (`names`: placeholder -> parameter name). The first call lays the parameters out as shards; under several
    stages a rank (`several`), each stage graph's first lays out those no earlier one did (param_shards.shard_more).
    Returns (ParamShards, the boxed callable AOTAutograd runs as the forward)."""
    ties = {n: t.key for n, t in setup.ties.items()}
    laid_out = set() if shards is None else {s.name for b in shards.layout.buckets for s in b.slots}
    new = set(names.values()) - laid_out
    before = len(shards.layout.buckets) if shards is not None else 0
    if shards is None:
        shards = shard_parameters(fw_gm, names, params, options, setup.grad_group.index, len(setup.grad_group.ranks),
                                  ties)
    elif new and several:
        shard_more(shards, fw_gm, names, params, options, ties)
    elif new:
        raise RuntimeError(
            f"gradsched shard='params': a second forward graph of stage {setup.stage} reads parameters "
            f"{sorted(new)} that the first did not (a graph break?). The parameters "
            "are laid out as shards from one forward graph: compile the stage with fullgraph=True.")
    try:
        gm, _, buckets, examples = run_passes("forward", fw_gm, example_inputs, setup,
                                              pass_pipeline.Conditions.of(options), {}, shards, names)
        fn = compile_graph(gm, examples, options.compiler,
                           agree=agreement_name(options, f"the forward graph of stage {setup.stage}"))
    except BaseException:
        shards.forget_after(before)  # this graph's own buckets go with its failed compile (the parameters are whole)
        raise
    if new:
        shards.release()  # the new ones (the others' storage is gone already)

    def forward(args):
        return fn(list(args) + shards.inputs(buckets))
    forward._boxed_call = True
    return shards, forward


def run_passes(graph: str, gm: fx.GraphModule, example_inputs, setup: StageSetup,
               conditions: pass_pipeline.Conditions, specs: dict, shards: ParamShards | None = None,
               names: dict | None = None):
    """The pass pipeline's entries for AOTAutograd's `graph` ("forward" or "backward"). Where gather_params
    applies, on a copy reading its parameters (`names`: placeholder -> parameter name) from gathered shards;
    the forward keeps its parameter placeholders (not their gathered views) in its output where the backward
    gathers again (reshard_after_forward).
    Returns (the graph, the records, the buckets whose shards it takes, its example inputs)."""
    if not pass_pipeline.applies(graph, "gather_params", conditions):
        return gm, pass_pipeline.run(graph, gm, conditions, specs), (), example_inputs
    gm, built = fx.GraphModule(gm, gm.graph.__deepcopy__()), gm
    gm.meta.update(built.meta)
    present = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    names = {ph: n for ph, n in (names or {}).items() if ph in present}
    keep = graph == "forward" and conditions.reshard_after_forward
    specs = {**specs, "gather_params": shards.spec(setup.grad_group.name, names, keep)}
    records = pass_pipeline.run(graph, gm, conditions, specs, what=f"stage {setup.stage} {graph} graph")
    buckets = records["gather_params"].buckets
    extra = shards.inputs(buckets)
    fake = detect_fake_mode(example_inputs)
    if fake is not None:
        extra = [fake.from_tensor(t, static_shapes=True) for t in extra]
    return gm, records, buckets, list(example_inputs) + extra


def check_sharded(ready, shards: ParamShards) -> None:
    laid_out = {s.name for b in shards.layout.buckets for s in b.slots}
    missing = sorted(laid_out - {r.name for r in ready})
    if missing:
        raise RuntimeError(
            f"gradsched shard='params': parameters {missing} are read by the forward graph but get no gradient "
            "in the backward graph; every sharded parameter needs one (its shard is stepped with it). Freeze them "
            "with requires_grad_(False) before parallelize, or train them.")


def agreement_name(options: SyncOptions, what: str) -> str | None:
    """A graph's name for the agreement on its collectives (none with check_ranks=False)."""
    return what if options.check_ranks else None


def _backward_graph(bw_gm, example_inputs, plan: SyncPlan, params, options: SyncOptions,
                    zero_bubble: bool = False) -> SyncGraph:
    gm, record = backward_sync_graph(bw_gm, plan, accumulate=options.microbatches > 1)
    extra = [torch.zeros(params[n].shape, dtype=params[n].dtype, device=params[n].device)
             for n in record.acc_inputs]
    fake = detect_fake_mode(example_inputs)
    if fake is not None:  # Inductor propagates fake values: the appended inputs must be fake too
        extra = [fake.from_tensor(t, static_shapes=True) for t in extra]
    what = f"the backward graph of stage {plan.stage} (the last micro-batch, with its reductions)"
    if pass_pipeline.applies("cut", "cut_backward", pass_pipeline.Conditions(zero_bubble=zero_bubble)):
        # everything but the inputs' gradients is W's: the weights' gradients and the reductions
        n_out = len(gm.graph.output_node().args[0])
        weights = {r.output_index for r in plan.ready} | set(range(record.n_outputs, n_out))
        fns = cut_graph(gm, list(example_inputs) + extra, weights, options, what, True)
        return SyncGraph("backward", plan.graphs["backward"], gm, record, None, halves=fns)
    fn = compile_graph(gm, list(example_inputs) + extra, options.compiler, comm_overlap=True,
                       agree=agreement_name(options, what))
    return SyncGraph("backward", plan.graphs["backward"], gm, record, fn)



def flush_graph(plan: SyncPlan, params, options: SyncOptions, where: str = "flush") -> SyncGraph:
    """The flush graph, or an early graph (compiled to return its reductions in flight)."""
    ready = plan.inputs(where)
    device = params[ready[0].name].device  # the gradients live where their parameters do
    gm, record = flush_sync_graph(plan, device, where)
    examples = [torch.zeros(r.shape, dtype=r.dtype, device=device) for r in ready]
    early = where != "flush"
    what = (f"the early reduction graph {where[5:]} of pipeline rank {plan.stage}" if early
            else f"the flush graph of stage {plan.stage}")
    fn = CompiledOnFirstCall(lambda: compile_graph(gm, examples, options.compiler, agree=agreement_name(options, what),
                                                   defer=early))
    return SyncGraph(where, plan.graphs[where], gm, record, fn, tuple(r.name for r in ready))


class CompiledOnFirstCall:
    """A boxed callable compiled when first called. The flush graph is built while AOTAutograd
    compiles the backward graph, and Inductor would take that compilation's fake mode (whose
    tensors are not the flush graph's) if it compiled the flush graph there."""
    _boxed_call = True

    def __init__(self, compile):
        self._compile, self._fn = compile, None

    def __call__(self, args):
        if self._fn is None:
            self._fn = self._compile()
        return self._fn(args)

    @property
    def source_code(self):
        return getattr(self._fn, "source_code", None)
