"""Build one stage's gradient sync at compile time: plan, passes, compiled graphs.

    build_stage(bw_gm, ...)        from the stage's AOT backward graph, in order:
      grad_ready_order               the order its gradients become ready
      check_backward_graph           refusals that need no other rank (gradsched.sync.preflight)
      plan_sync                      the SyncPlan: buckets, groups, which graph reduces each
      compile the plain backward     earlier micro-batches: autograd accumulates in .grad
      backward_sync_graph            the last micro-batch's backward with its reductions
                                     (gradsched.sync.sync_graphs: insert_grad_sync, sink_waits)
      flush_sync_graph               the reductions that wait for the schedule to drain
      split_backward                 (a zero-bubble schedule) each backward cut in B, the inputs'
                                     gradients, and W, the weights': each half compiled

    build_part(bw_gm, ...) and build_union(parts, ...)   several stages a rank: each stage's backward
                                     compiled as it comes (whole, or B and W); once every stage has one, the
                                     plan over all of the rank's gradients, its flush graph and (B and W)
                                     the early graphs of the buckets final before the last stage's W

Returns a BuiltStage: plain data and compiled callables, which the executor
(gradsched.sync.runtime.GradSync) runs and nothing else builds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from gradsched.passes import grad_ready_order
from gradsched.passes.param_gather import gather_params
from gradsched.passes.bucketing import BucketLayout, place_after
from gradsched.passes.grad_sync import SyncRecord
from gradsched.passes.split_backward import SplitRecord, SplitSpec, split_backward

from gradsched.sync.compile import compile_graph
from gradsched.options import SyncOptions
from gradsched.sync.param_shards import ParamShards, shard_parameters
from gradsched.sync.preflight import check_backward_graph
from gradsched.sync.stage_setup import StageSetup
from gradsched.sync.sync_graphs import backward_sync_graph, flush_sync_graph
from gradsched.sync.sync_plan import SyncPlan, plan_layout, plan_sync


@dataclass
class SplitFns:
    """A backward graph cut in B and W (passes/split_backward.py), each half compiled (boxed callables)."""
    record: SplitRecord
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
    split: SplitFns | None = None  # backward graph under a zero-bubble schedule: B and W, run in place of fn

    @property
    def code(self) -> str | None:
        """Inductor's output code for this graph (None under compiler='eager'); B's then W's when split."""
        if self.split is not None:
            codes = [getattr(f, "source_code", None) for f in (self.split.b, self.split.w)]
            return None if None in codes else "\n".join(codes)
        return getattr(self.fn, "source_code", None)


@dataclass
class BuiltStage:
    plan: SyncPlan
    params: dict  # name -> the stage's trained Parameter
    plain: object  # the unchanged backward, compiled (micro-batches before the last)
    graphs: dict  # "backward" and/or "flush" -> SyncGraph, as the plan places buckets
    param_inputs: tuple = ()  # shard="params": the buckets whose shards the backward graphs take, appended
    plain_split: SplitFns | None = None  # under a zero-bubble schedule: the plain backward as B and W
    grad_names: dict | None = None  # backward output position -> parameter name
    order: tuple = ()  # several stages a rank: the parts in the order they finish a step (early graphs), or ()


def build_stage(bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str],
                params: dict[str, torch.nn.Parameter], setup: StageSetup, options: SyncOptions,
                first: BuiltStage | None = None, shards: ParamShards | None = None,
                param_names: dict | None = None, split: bool = False) -> BuiltStage:
    """`grad_names`: backward output index -> parameter name; `first`: the stage's earlier build
    (a recompile must train the same parameters); `shards`: where the parameters live (shard="params"),
    `param_names`: this backward's forward graph's placeholder -> parameter name (the backward's saved
    inputs keep the forward's names; they mean other parameters in another graph)."""
    param_inputs = ()
    if shards is not None and options.reshard_after_forward:  # the backward gathers what it reads again
        bw_gm, param_inputs, example_inputs = _gathering(bw_gm, example_inputs, shards, param_names or {}, setup,
                                                         False)
    ready = grad_ready_order(bw_gm, grad_names)
    check_backward_graph(setup, ready, list(first.plan.ready) if first else None)
    if shards is not None:
        _check_sharded(ready, shards)
    plan = plan_sync(ready, options, stage=setup.stage, rank=setup.rank, placement=setup.placement,
                     grad_group=setup.grad_group, tie_groups=setup.tie_groups,
                     ties={n: t.key for n, t in setup.ties.items()},
                     param_dtypes={n: p.dtype for n, p in params.items()},
                     layout=shards.layout if shards is not None else None,
                     every_rank=set(setup.grad_group.ranks) == set(setup.all_ranks.ranks))
    graphs = {}
    if "backward" in plan.graphs:
        graphs["backward"] = _backward_graph(bw_gm, example_inputs, plan, params, options, split)
    if "flush" in plan.graphs:
        graphs["flush"] = _flush_graph(plan, params, options)
    what = f"the backward graph of stage {setup.stage} (a micro-batch before the last)"
    if split:
        plain_split = _split(bw_gm, example_inputs, set(grad_names), options, what)
        return BuiltStage(plan, params, None, graphs, param_inputs, plain_split, dict(grad_names))
    plain = compile_graph(bw_gm, example_inputs, options.compiler, agree=_name(options, what))
    return BuiltStage(plan, params, plain, graphs, param_inputs, grad_names=dict(grad_names))


@dataclass
class StagePart:
    """One stage graph of a rank that holds several: its gradients' ready order, its parameters (by the rank's
    names), and its backward compiled whole or as B and W. Autograd (or W) accumulates its gradients in .grad
    every micro-batch; the rank's flush reduces them, or an early graph as the part finishes (build_union)."""
    ready: list
    params: dict
    grad_names: dict  # backward output position -> parameter name
    plain: object
    plain_split: SplitFns | None


def build_part(bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str], params: dict,
               setup: StageSetup, options: SyncOptions, split: bool) -> StagePart:
    """A stage graph of a rank of several stages (names: the rank's, a tie merged on the rank under one)."""
    ready = grad_ready_order(bw_gm, grad_names)
    what = f"a backward graph of pipeline rank {setup.stage}'s stages ({ready[0].name if ready else 'no gradient'}...)"
    if split:
        return StagePart(ready, params, dict(grad_names), None, _split(bw_gm, example_inputs, set(grad_names),
                                                                        options, what))
    return StagePart(ready, params, dict(grad_names),
                     compile_graph(bw_gm, example_inputs, options.compiler, agree=_name(options, what)), None)


def build_union(parts: list[StagePart], setup: StageSetup, options: SyncOptions,
                order: tuple[int, ...] = ()) -> BuiltStage:
    """The sync of a rank of several stages: one plan over every stage graph's gradients (each once), reduced
    after the schedule by one flush graph (placement 'flush': no one backward graph holds the rank's gradients).
    Ties across ranks are summed there, first, as at one stage.

    `order`: the parts in the order their last W finished on the first step (B and W, shard=True), or empty.
    Given, the gradients are laid out in that order and each bucket whose every gradient is final before the
    last part finishes goes to that point's early graph ("early{j}", passes/bucketing.place_after), run there
    and waited for at the flush (gradsched.sync.early_reduce)."""
    params = {n: p for part in parts for n, p in part.params.items()}
    ready, final_at = finishing_points([part.ready for part in parts], order)
    check_backward_graph(setup, ready, None)
    ties = {n: t.key for n, t in setup.ties.items()}
    layout = None
    if len(order) > 1:  # no bucket spans two points: each point's gradients bucketed on their own
        points = [[r for r in ready if final_at[r.name] == j] for j in range(len(order))]
        layout = _concatenated([plan_layout(p, options, len(setup.grad_group.ranks), ties) for p in points if p])
    plan = plan_sync(ready, options, stage=setup.stage, rank=setup.rank, placement="flush",
                     grad_group=setup.grad_group, tie_groups=setup.tie_groups, ties=ties,
                     param_dtypes={n: p.dtype for n, p in params.items()}, layout=layout)
    # not under shard=False (all-reduced buckets hand out views, read only once waited), nor for a gradient group
    # of one rank: its reduction is a copy, nothing to overlap, and it would hold a second copy of the gradients
    # until the flush (an early reduction's input and output both live until then)
    # (and not under an explicit placement="flush": every bucket after the schedule)
    if len(order) > 1 and plan.shard and len(setup.grad_group.ranks) > 1 and setup.placement == "split":
        plan = dataclasses.replace(plan, graphs=place_after(plan.layout, final_at, len(order)))
    early = any(w.startswith("early") for w in plan.graphs)
    return BuiltStage(plan, params, None, {w: _flush_graph(plan, params, options, w) for w in plan.graphs},
                      order=tuple(order) if early else ())


def finishing_points(parts_ready: list[list], order: tuple[int, ...]) -> tuple[list, dict]:
    """(every gradient once, in the order the parts finish (`order`; else as given), and name -> the point at
    which it is final: its last writer's position in that order; a gradient two parts write, a tie on the rank,
    is final after the later)."""
    ready, final_at = {}, {}
    for j, part in enumerate([parts_ready[i] for i in order] if order else parts_ready):
        for r in part:
            ready.setdefault(r.name, r)
            final_at[r.name] = j
    return list(ready.values()), final_at


def _concatenated(layouts: list[BucketLayout]) -> BucketLayout:
    """One layout of several, in order, the buckets numbered on."""
    buckets = [b for lay in layouts for b in lay.buckets]
    return BucketLayout(tuple(dataclasses.replace(b, index=i) for i, b in enumerate(buckets)), layouts[0].shards)


def _split(gm: fx.GraphModule, example_inputs, weight_outputs: set, options: SyncOptions, what: str,
           comm_overlap: bool = False) -> SplitFns:
    """gm cut in B and W, each compiled; W's example inputs are the stash's values (node.meta["val"], in the
    backward's fake mode) and the inputs it reads."""
    _, rec = split_backward(gm, SplitSpec(frozenset(weight_outputs)))
    b_examples = [example_inputs[i] for i in rec.b_inputs]
    stash = [n.meta["val"] for n in rec.w.graph.find_nodes(op="placeholder")][:len(rec.stash)]
    w_examples = stash + [example_inputs[i] for i in rec.w_inputs]
    b = compile_graph(rec.b, b_examples, options.compiler, comm_overlap,
                      agree=_name(options, f"{what}, its inputs' gradients (B)"))
    w = compile_graph(rec.w, w_examples, options.compiler, comm_overlap,
                      agree=_name(options, f"{what}, its weights' gradients (W)"))
    return SplitFns(rec, b, w)


def build_forward(fw_gm: fx.GraphModule, example_inputs, names: dict, params: dict, setup: StageSetup,
                  options: SyncOptions, shards: ParamShards | None):
    """shard="params": the stage's forward graph, gathering each bucket's parameters before use
    (`names`: placeholder -> parameter name). The first call lays the parameters out as shards.
    Returns (ParamShards, the boxed callable AOTAutograd runs as the forward)."""
    first = shards is None
    if first:
        shards = shard_parameters(fw_gm, names, params, options, setup.grad_group.index, len(setup.grad_group.ranks),
                                  {n: t.key for n, t in setup.ties.items()})
    laid_out = {s.name for b in shards.layout.buckets for s in b.slots}
    if set(names.values()) - laid_out:
        raise RuntimeError(
            f"gradsched shard='params': a second forward graph of stage {setup.stage} reads parameters "
            f"{sorted(set(names.values()) - laid_out)} that the first did not (a graph break?). The parameters "
            "are laid out as shards from one forward graph: compile the stage with fullgraph=True.")
    gm, buckets, examples = _gathering(fw_gm, example_inputs, shards, names, setup, options.reshard_after_forward)
    fn = compile_graph(gm, examples, options.compiler,
                       agree=_name(options, f"the forward graph of stage {setup.stage}"))
    if first:
        shards.release()

    def forward(args):
        return fn(list(args) + shards.inputs(buckets))
    forward._boxed_call = True
    return shards, forward


def _gathering(gm: fx.GraphModule, example_inputs, shards: ParamShards, names: dict, setup: StageSetup,
               keep_placeholders_in_output: bool):
    """(a copy of gm reading its parameters (`names`: placeholder -> parameter name) from gathered shards,
    the buckets whose shards it takes, its example inputs)."""
    gm, built = fx.GraphModule(gm, gm.graph.__deepcopy__()), gm
    gm.meta.update(built.meta)
    present = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    names = {ph: n for ph, n in names.items() if ph in present}
    _, record = gather_params(gm, shards.spec(setup.grad_group.name, names, keep_placeholders_in_output))
    extra = shards.inputs(record.buckets)
    fake = detect_fake_mode(example_inputs)
    if fake is not None:
        extra = [fake.from_tensor(t, static_shapes=True) for t in extra]
    return gm, record.buckets, list(example_inputs) + extra


def _check_sharded(ready, shards: ParamShards) -> None:
    laid_out = {s.name for b in shards.layout.buckets for s in b.slots}
    missing = sorted(laid_out - {r.name for r in ready})
    if missing:
        raise RuntimeError(
            f"gradsched shard='params': parameters {missing} are read by the forward graph but get no gradient "
            "in the backward graph; every sharded parameter needs one (its shard is stepped with it). Freeze them "
            "with requires_grad_(False) before parallelize, or train them.")


def _name(options: SyncOptions, what: str) -> str | None:
    """A graph's name for the agreement on its collectives (none with check_ranks=False)."""
    return what if options.check_ranks else None


def _backward_graph(bw_gm, example_inputs, plan: SyncPlan, params, options: SyncOptions,
                    split: bool = False) -> SyncGraph:
    gm, record = backward_sync_graph(bw_gm, plan, accumulate=options.microbatches > 1)
    extra = [torch.zeros(params[n].shape, dtype=params[n].dtype, device=params[n].device)
             for n in record.acc_inputs]
    fake = detect_fake_mode(example_inputs)
    if fake is not None:  # Inductor propagates fake values: the appended inputs must be fake too
        extra = [fake.from_tensor(t, static_shapes=True) for t in extra]
    what = f"the backward graph of stage {plan.stage} (the last micro-batch, with its reductions)"
    if split:  # everything but the inputs' gradients is W's: the weights' gradients and the reductions
        n_out = len(gm.graph.output_node().args[0])
        weights = {r.output_index for r in plan.ready} | set(range(record.n_outputs, n_out))
        fns = _split(gm, list(example_inputs) + extra, weights, options, what, True)
        return SyncGraph("backward", plan.graphs["backward"], gm, record, None, split=fns)
    fn = compile_graph(gm, list(example_inputs) + extra, options.compiler, comm_overlap=True,
                       agree=_name(options, what))
    return SyncGraph("backward", plan.graphs["backward"], gm, record, fn)



def _flush_graph(plan: SyncPlan, params, options: SyncOptions, where: str = "flush") -> SyncGraph:
    """The flush graph, or an early graph (compiled to return its reductions in flight)."""
    ready = plan.inputs(where)
    device = params[ready[0].name].device  # the gradients live where their parameters do
    gm, record = flush_sync_graph(plan, device, where)
    examples = [torch.zeros(r.shape, dtype=r.dtype, device=device) for r in ready]
    early = where != "flush"
    what = (f"the early reduction graph {where[5:]} of pipeline rank {plan.stage}" if early
            else f"the flush graph of stage {plan.stage}")
    fn = CompiledOnFirstCall(lambda: compile_graph(gm, examples, options.compiler, agree=_name(options, what),
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
