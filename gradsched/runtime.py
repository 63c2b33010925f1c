"""GradSync: runs the gradient-sync pass pipeline on one stage and executes its graphs.

One GradSync per pipeline stage (per process). The backend hands it the
stage's backward graph; it reads the ready order and builds the stage's
SyncPlan once (gradsched.sync_plan: buckets, groups, which graph reduces
each bucket; plain data, handed to the pass, the report and the optimizer),
then runs the passes on each graph it places reductions in:

  in the backward: a second variant of the backward graph with the collectives
      inserted, used on the last micro-batch of each step (earlier micro-batches
      run the plain graph and accumulate in .grad). Which backward is the last
      is said by the caller (`step_boundary`), from the schedule, never counted;
  at the flush: a standalone sync graph, run once per step after the pipeline
      schedule has drained (`flush()`).

placement="split" (the default for pp > 1) reduces every bucket without a tied
gradient in the backward, where it overlaps the other stages' remaining work,
and only the buckets that hold a tied gradient at the flush: their tie
all-reduce needs every stage holding a copy, and a stage's backward cannot wait
on another stage before it has sent its input gradient. "backward" and
"flush" put every bucket in one place.

Before a sync graph's first collective it exchanges collective fingerprints
and tie layouts over each of its groups, verifies the graph, and refuses to
run a hazard.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from gradsched.passes import GradSpec, TieCheck, TieLayout, grad_ready_order, verify_graph
from gradsched.passes.bucketing import BucketLayout
from gradsched.passes.verify import TiedGradientHazard, graph_to_json

from . import fingerprint, report
from .compile import compile_graph
from .optimizer import mark_sharded
from .options import SyncOptions
from .plan import ParallelPlan
from .sync_graphs import backward_sync_graph, flush_sync_graph
from .sync_plan import Group, SyncPlan, plan_sync
from .ties import Tie, TieMismatch


@dataclass
class SyncGraph:
    """One compiled graph reducing some of a stage's buckets: its buckets, graph, callable, verdict."""
    where: str  # "backward" (the last micro-batch's backward graph) or "flush"
    layout: BucketLayout  # the buckets it reduces, with their indices in the stage's layout
    gm: fx.GraphModule | None = None
    record: object = None  # the grad-sync pass's SyncRecord for gm
    fn: object = None
    checked: bool = False
    verdict: object = None

    @property
    def code(self) -> str | None:
        """Inductor's output code for this graph (None under compiler='eager')."""
        return getattr(self.fn, "source_code", None)


@dataclass
class StageSync:
    """The compiled state of one stage: layout, its sync graphs, results of the last sync."""
    ready: list[GradSpec]
    layout: BucketLayout
    params: dict[str, torch.nn.Parameter]
    graphs: dict[str, SyncGraph] = field(default_factory=dict)  # "backward" and/or "flush"
    results: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket index -> this step's reduced shard

    def reduced(self) -> list[torch.Tensor]:
        """This step's reduced buckets in layout order (shorter until every graph has run)."""
        return [self.results[b.index] for b in self.layout.buckets if b.index in self.results]

    @property
    def verdicts(self) -> list:
        return [g.verdict for g in self.graphs.values() if g.verdict is not None]


class GradSync:
    def __init__(self, plan: ParallelPlan, options: SyncOptions, ties: list[Tie] = (), stage: int | None = None,
                 aliases: list[list[str]] = ()):
        self.plan, self.options = plan, options
        self.aliases = [set(a) for a in aliases]  # names of one Parameter in the unsplit model
        self.stage = plan.stage if stage is None else stage
        self.all_ties = sorted(ties, key=lambda t: t.key)
        for t in self.all_ties:  # every rank creates every tie group, in one order
            plan.tie_group(t.stages)
        self.ties = {t.name_on(self.stage): t for t in self.all_ties if t.name_on(self.stage)}
        self.placement = options.placement
        if self.placement == "auto":
            self.placement = "backward" if plan.pp == 1 else "split"
        if self.placement == "backward" and self.ties:
            raise ValueError(
                "placement='backward' with weights tied across pipeline stages would deadlock: a stage's "
                "backward would wait on the other stage before sending its input gradient. Use "
                "placement='split' (the default for pp > 1: only the tied buckets wait for the flush) or 'flush'.")
        self.state: StageSync | None = None
        self.sync_plan: SyncPlan | None = None  # built from the first backward graph, then fixed
        # explicit_steps: a driver (ParallelModel.train_step) marks the last micro-batch's backward
        # with step_boundary(); without one (the backend by name), every backward ends a step
        self.explicit_steps = False
        self._last_microbatch = False
        self.backward_calls = 0  # for reports and tests only: nothing is decided by counting
        self.sync_runs = 0  # steps whose gradients were reduced: once per optimizer step
        self.flush_seconds: list[float] = []  # wall time of each flush graph run

    @contextlib.contextmanager
    def step_boundary(self, last: bool):
        """Backward passes run inside belong to the step's last micro-batch (last=True) or not."""
        self.explicit_steps, before = True, self._last_microbatch
        self._last_microbatch = last
        try:
            yield
        finally:
            self._last_microbatch = before

    def _ends_step(self) -> bool:
        return self._last_microbatch if self.explicit_steps else True

    # ---- groups and specs ---------------------------------------------------------------
    def grad_group(self):
        """(process group, its plan ranks, this rank's index in it): gradients are reduced here."""
        ranks = self.plan.group_ranks("grad")
        return self.plan.process_group("grad"), ranks, ranks.index(self.plan.rank)

    def tie_group_of(self, tie: Tie):
        """(plan ranks, process group) summing `tie`'s copies for this rank's dp/cp slot."""
        return self.plan.tie_group(tie.stages)

    # ---- called by the backend ------------------------------------------------------------
    def register_backward(self, bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str],
                          params: dict[str, torch.nn.Parameter]):
        """Plan buckets from this backward graph; return the callable to run as backward."""
        ready = grad_ready_order(bw_gm, grad_names)
        if self.state is not None and [r.name for r in self.state.ready] != [r.name for r in ready]:
            raise RuntimeError(
                "gradsched: a second backward graph with different parameters was compiled for this stage "
                f"(graph break?). First: {[r.name for r in self.state.ready]}; now: {[r.name for r in ready]}. "
                "Compile the stage with fullgraph=True.")
        for group in self.aliases:
            copies = sorted(group & {r.name for r in ready})
            if len(copies) > 1:
                raise TieMismatch(
                    f"stage {self.stage} trains {copies} as separate parameters, but they are one weight of the "
                    "model: the pipeline split gave one of its uses a copy of its own, which no tie records, so "
                    "the copies would get different gradients and drift apart. Choose split points that keep "
                    "every use of a shared weight but one per stage on one side, or untie it.")
        unknown = sorted(set(self.ties) - {r.name for r in ready})
        if unknown:
            raise TieMismatch(f"tied parameter(s) {unknown} of stage {self.stage} get no gradient in its "
                              "backward graph: the tie declaration does not match the model.")
        pg, ranks, me = self.grad_group()
        tie_groups = {}
        for t in self.ties.values():
            tranks, tpg = self.tie_group_of(t)
            tie_groups[t.key] = Group(tpg.group_name, tuple(tranks), list(tranks).index(self.plan.rank))
        self.sync_plan = plan_sync(ready, self.options, stage=self.stage, rank=self.plan.rank,
                                   placement=self.placement, grad_group=Group(pg.group_name, tuple(ranks), me),
                                   tie_groups=tie_groups, ties={n: t.key for n, t in self.ties.items()},
                                   param_dtypes={n: p.dtype for n, p in params.items()})
        self.state = StageSync(ready, self.sync_plan.layout, params)
        self.state.graphs = {where: SyncGraph(where, part) for where, part in self.sync_plan.graphs.items()}
        attach(self, params.values())
        if self.options.shard:
            mark_sharded(params.values())
        compiled = compile_graph(bw_gm, example_inputs, self.options.compiler)

        def plain(args):  # earlier micro-batches (or every one, with nothing to reduce here): autograd accumulates
            self.backward_calls += 1
            return compiled(args)
        plain._boxed_call = True
        sg = self.state.graphs.get("backward")
        if sg is None:
            return plain

        sync_gm, record = backward_sync_graph(bw_gm, self.sync_plan, accumulate=self.options.microbatches > 1)
        extra = [torch.zeros(params[n].shape, dtype=params[n].dtype, device=params[n].device)
                 for n in record.acc_inputs]
        fake = detect_fake_mode(example_inputs)
        if fake is not None:  # Inductor propagates fake values: the appended inputs must be fake too
            extra = [fake.from_tensor(t, static_shapes=True) for t in extra]
        sg.gm, sg.record = sync_gm, record
        sg.fn = compile_graph(sync_gm, list(example_inputs) + extra, self.options.compiler, comm_overlap=True)

        def backward(args):
            if not self._ends_step():
                return plain(args)
            self.backward_calls += 1
            acc = [_grad_or_zeros(params[n]) for n in record.acc_inputs]
            self._check_once(sg)
            outs = list(sg.fn(list(args) + acc))
            for n in record.acc_inputs:
                params[n].grad = None  # consumed: the reduced gradient replaces it
            self.state.results.update(zip((b.index for b in sg.layout.buckets), outs[record.n_outputs:]))
            if "flush" not in self.state.graphs:
                self.sync_runs += 1
            return outs[:record.n_outputs]
        backward._boxed_call = True
        return backward

    # ---- the flush ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Reduce what waits for the end of the step (every bucket under placement='flush', the tied
        ones under 'split'); call once per step, after the schedule. Nothing to do otherwise."""
        if self.state is None and self.placement == "backward":
            return
        st = self._require_state()
        sg = st.graphs.get("flush")
        if sg is None:
            return
        ready = self.sync_plan.flush_inputs()
        if sg.fn is None:
            device = st.params[ready[0].name].device
            sg.gm, sg.record = flush_sync_graph(self.sync_plan, device)
            examples = [torch.zeros(r.shape, dtype=r.dtype, device=device) for r in ready]
            sg.fn = compile_graph(sg.gm, examples, self.options.compiler)
        self._check_once(sg)
        t0 = time.perf_counter()
        outs = list(sg.fn([_grad_or_zeros(st.params[r.name]) for r in ready]))
        self.flush_seconds.append(time.perf_counter() - t0)  # the step's tail after the schedule (benchmarks)
        self.sync_runs += 1
        results = outs if self.options.shard else outs[len(ready):]
        st.results.update(zip((b.index for b in sg.layout.buckets), results))
        if self.options.shard:  # the shards are the gradients now; .grad would be stale
            for r in ready:
                st.params[r.name].grad = None
        else:  # all-reduced: each parameter's .grad is its view of the reduced bucket
            for r, g in zip(ready, outs):
                st.params[r.name].grad = g

    # ---- checks before the first collective ----------------------------------------------
    def _check_once(self, sg: SyncGraph) -> None:
        """Before a sync graph's first collective: the cross-rank check over each of its groups, then
        the verifier. A graph without tie collectives (split's backward graph) talks to its gradient
        group only: the other stages are still in the schedule."""
        if sg.checked:
            return
        sg.checked = True
        st, record = self.state, sg.record
        names = {s.name for b in sg.layout.buckets for s in b.slots}
        ties = {n: t for n, t in self.ties.items() if n in names}
        layouts = {}
        for name, tie in ties.items():
            bucket, slot = st.layout.locate(name)
            layouts[tie.key] = TieLayout(self.plan.rank, name, bucket.index, slot.offset, slot.numel,
                                         bucket.numel, st.layout.shards)
        peers, sequences = {}, {}
        if self.options.check_ranks:
            peers, sequences = fingerprint.exchange_and_check(self, sg.gm, layouts, ties)
        checks = [TieCheck(t.key, record.spec.tie_groups[t.key], record.sources[n],
                           [layouts[t.key]] + peers.get(t.key, []), sequences.get(t.key, {}))
                  for n, t in sorted(ties.items(), key=lambda kv: kv[1].key)]
        sg.verdict = verify_graph(sg.gm, checks, self.plan.rank)
        if self.options.dump_dir:
            os.makedirs(self.options.dump_dir, exist_ok=True)
            suffix = "" if len(st.graphs) == 1 else f".{sg.where}"
            with open(os.path.join(self.options.dump_dir, f"rank{self.plan.rank}{suffix}.json"), "w") as f:
                json.dump(graph_to_json(sg.gm, checks, self.plan.rank), f)
        if not sg.verdict.ok:
            if not self.options.allow_hazard:
                raise TiedGradientHazard(f"gradsched refuses to run this gradient sync:\n{sg.verdict}")
            warnings.warn(f"gradsched: running a graph with a known hazard (allow_hazard=True):\n{sg.verdict}")

    # ---- for the optimizer and the report -------------------------------------------------
    def _require_state(self) -> StageSync:
        if self.state is None:
            raise RuntimeError("gradsched: no backward graph has been compiled for this stage yet: run a "
                               "forward and backward first.")
        return self.state

    @property
    def layout(self):
        return self._require_state().layout

    @property
    def results(self) -> list[torch.Tensor]:
        """This step's reduced buckets (shards, or whole buckets with shard=False) in layout order."""
        return self._require_state().reduced()

    def clear_results(self) -> None:
        """The optimizer has consumed this step's reduced buckets."""
        self._require_state().results.clear()

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """The stage's trained parameters by name, as the plan names them."""
        return self._require_state().params

    def sync_graphs(self) -> list[SyncGraph]:
        """The built sync graphs, in run order: the backward's, then the flush's."""
        st = self._require_state()
        return [st.graphs[w] for w in ("backward", "flush") if w in st.graphs and st.graphs[w].gm is not None]

    def schedule_report(self) -> str:
        return report.schedule_report(self)

    def tied_bytes_per_step(self) -> int:
        return sum(report.tied_bytes(sg.gm) for sg in self.sync_graphs())


def attach(sync: GradSync, params) -> None:
    """Remember which GradSync reduces these parameters (the optimizer finds it from them)."""
    for p in params:
        p._gradsched_sync = sync


def sync_of(params) -> GradSync | None:
    """The GradSync that reduces these parameters' gradients, if a gradsched backend compiled them."""
    found = {id(s): s for s in (getattr(p, "_gradsched_sync", None) for p in params) if s is not None}
    if len(found) > 1:
        raise RuntimeError("gradsched: these parameters are reduced by several compiled models; build one "
                           "DistributedOptimizer per compiled model.")
    return next(iter(found.values()), None)


def _grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
