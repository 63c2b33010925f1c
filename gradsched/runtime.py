"""GradSync: runs the gradient-sync pass pipeline on one stage and executes its graphs.

One GradSync per pipeline stage (per process). The backend hands it the
stage's backward graph; it reads the ready order, plans buckets, and either

  placement="backward": compiles a second variant of the backward graph with
      the collectives inserted, used on the last micro-batch of each step
      (earlier micro-batches run the plain graph and accumulate in .grad). Which
      backward is the last is said by the caller (`step_boundary`), from the
      schedule, never counted; or
  placement="flush": compiles a standalone sync graph, run once per step after
      the pipeline schedule has drained (`flush()`).

Before a sync graph's first collective it exchanges collective fingerprints
and tie layouts over each of its groups, verifies the graph, and refuses to
run a hazard.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from gradsched.passes import GradSpec, SyncSpec, TieCheck, TieLayout, grad_ready_order, insert_grad_sync, \
    plan_buckets, verify_graph
from gradsched.passes.graph_utils import META_KEY
from gradsched.passes.verify import TiedGradientHazard, graph_to_json

from . import fingerprint, report
from .compile import compile_graph
from .optimizer import mark_sharded
from .options import SyncOptions
from .plan import ParallelPlan
from .ties import Tie, TieMismatch


@dataclass
class StageSync:
    """The compiled state of one stage: layout, graphs, results of the last sync."""
    ready: list[GradSpec]
    layout: object
    params: dict[str, torch.nn.Parameter]
    sync_gm: fx.GraphModule | None = None
    sync_fn: object = None
    checked: bool = False
    results: list[torch.Tensor] = field(default_factory=list)
    verdict: object = None


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
            self.placement = "backward" if plan.pp == 1 else "flush"
        if self.placement == "backward" and self.ties:
            raise ValueError(
                "placement='backward' with weights tied across pipeline stages would deadlock: a stage's "
                "backward would wait on the other stage before sending its input gradient. Use "
                "placement='flush' (the default for pp > 1).")
        self.state: StageSync | None = None
        # explicit_steps: a driver (ParallelModel.train_step) marks the last micro-batch's backward
        # with step_boundary(); without one (the backend by name), every backward ends a step
        self.explicit_steps = False
        self._last_microbatch = False
        self.backward_calls = 0  # for reports and tests only: nothing is decided by counting
        self.sync_runs = 0  # executions of the sync graph: once per optimizer step

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

    def _spec(self, layout, grad_outputs, accumulate) -> SyncSpec:
        pg, ranks, me = self.grad_group()
        return SyncSpec(layout=layout, grad_outputs=grad_outputs, group=pg.group_name, group_size=len(ranks),
                        shard_rank=me, tie_groups={t.key: self.tie_group_of(t)[1].group_name
                                                   for t in self.ties.values()},
                        mode=self.options.mode, shard=self.options.shard, average=self.options.average,
                        accumulate=accumulate)

    # ---- called by the backend ------------------------------------------------------------
    def register_backward(self, bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str],
                          params: dict[str, torch.nn.Parameter]):
        """Plan buckets from this backward graph; return the callable to run as backward."""
        _maybe_print(bw_gm, f"stage {self.stage} backward graph, before the gradient-sync passes")
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
        layout = plan_buckets(ready, bucket_mb=self.options.bucket_mb, shards=len(self.plan.group_ranks("grad")),
                              reduce_dtype=self.options.reduce_dtype,
                              ties={n: t.key for n, t in self.ties.items()},
                              # a bucket of its own for each tied gradient: shard_aligned needs it for
                              # correctness; tied_first for bitwise-equal copies (the reduce-scatter
                              # then sums every copy's elements in the same order). unsafe_rs_first
                              # keeps ready order, where #844 bites.
                              align_ties=self.options.mode != "unsafe_rs_first")
        self.state = StageSync(ready, layout, params)
        attach(self, params.values())
        if self.options.shard:
            mark_sharded(params.values())
        compiled = compile_graph(bw_gm, example_inputs, self.options.compiler)

        def plain(args):  # earlier micro-batches (or every one, under flush): autograd accumulates
            self.backward_calls += 1
            return compiled(args)
        plain._boxed_call = True
        if self.placement == "flush":
            return plain

        accumulate = self.options.microbatches > 1
        sync_gm = fx.GraphModule(bw_gm, bw_gm.graph.__deepcopy__())
        sync_gm.meta.update(bw_gm.meta)
        insert_grad_sync(sync_gm, self._spec(layout, {r.name: r.output_index for r in ready}, accumulate))
        _maybe_print(sync_gm, f"stage {self.stage} backward graph, after insert_grad_sync")
        record = sync_gm.meta[META_KEY]
        extra = [torch.zeros(params[n].shape, dtype=params[n].dtype, device=params[n].device)
                 for n in record.acc_inputs]
        fake = detect_fake_mode(example_inputs)
        if fake is not None:  # Inductor propagates fake values: the appended inputs must be fake too
            extra = [fake.from_tensor(t, static_shapes=True) for t in extra]
        self.state.sync_gm = sync_gm
        self.state.sync_fn = compile_graph(sync_gm, list(example_inputs) + extra, self.options.compiler)

        def backward(args):
            if not self._ends_step():
                return plain(args)
            self.backward_calls += 1
            acc = [_grad_or_zeros(params[n]) for n in record.acc_inputs]
            self._check_once()
            outs = list(self.state.sync_fn(list(args) + acc))
            self.sync_runs += 1
            for n in record.acc_inputs:
                params[n].grad = None  # consumed: the reduced gradient replaces it
            self.state.results = outs[record.n_outputs:]
            return outs[:record.n_outputs]
        backward._boxed_call = True
        return backward

    # ---- flush placement ------------------------------------------------------------------
    def flush(self) -> None:
        """Reduce this step's accumulated gradients (placement='flush'); call once per step."""
        if self.placement != "flush":
            return
        st = self._require_state()
        if st.sync_fn is None:
            st.sync_gm = self._build_flush_graph(st)
            examples = [torch.zeros(r.shape, dtype=r.dtype) for r in st.ready]
            st.sync_fn = compile_graph(st.sync_gm, examples, self.options.compiler)
        self._check_once()
        grads = [_grad_or_zeros(st.params[r.name]) for r in st.ready]
        outs = list(st.sync_fn(grads))
        self.sync_runs += 1
        if self.options.shard:  # the shards are the gradients now; .grad would be stale
            st.results = outs
            for r in st.ready:
                st.params[r.name].grad = None
        else:  # all-reduced: each parameter's .grad is its view of the reduced bucket
            st.results = outs[len(st.ready):]
            for r, g in zip(st.ready, outs):
                st.params[r.name].grad = g

    def _build_flush_graph(self, st: StageSync) -> fx.GraphModule:
        g, fake = fx.Graph(), FakeTensorMode()
        phs = []
        for i, r in enumerate(st.ready):
            ph = g.placeholder(f"grad_{i}")
            ph.meta["val"] = fake.from_tensor(torch.empty(r.shape, dtype=r.dtype))
            phs.append(ph)
        g.output(tuple(phs))
        gm = fx.GraphModule(torch.nn.Module(), g)
        insert_grad_sync(gm, self._spec(st.layout, {r.name: i for i, r in enumerate(st.ready)}, False))
        record = gm.meta[META_KEY]
        if self.options.shard:  # the gradient outputs are None: return the shards only
            out = gm.graph.output_node()
            out.args = (tuple(out.args[0][record.n_outputs:]),)
            gm.recompile()
        _maybe_print(gm, f"stage {self.stage} flush graph, after insert_grad_sync")
        return gm

    # ---- checks before the first collective ----------------------------------------------
    def _check_once(self) -> None:
        st = self.state
        if st.checked:
            return
        st.checked = True
        record = st.sync_gm.meta[META_KEY]
        layouts = {}
        for name, tie in self.ties.items():
            bucket, slot = st.layout.locate(name)
            layouts[tie.key] = TieLayout(self.plan.rank, name, bucket.index, slot.offset, slot.numel,
                                         bucket.numel, st.layout.shards)
        peers, sequences = {}, {}
        if self.options.check_ranks:
            peers, sequences = fingerprint.exchange_and_check(self, st.sync_gm, layouts)
        ties = [TieCheck(t.key, record.spec.tie_groups[t.key], record.sources[n],
                         [layouts[t.key]] + peers.get(t.key, []), sequences.get(t.key, {}))
                for n, t in sorted(self.ties.items(), key=lambda kv: kv[1].key)]
        st.verdict = verify_graph(st.sync_gm, ties, self.plan.rank)
        if self.options.dump_dir:
            os.makedirs(self.options.dump_dir, exist_ok=True)
            with open(os.path.join(self.options.dump_dir, f"rank{self.plan.rank}.json"), "w") as f:
                json.dump(graph_to_json(st.sync_gm, ties, self.plan.rank), f)
        if not st.verdict.ok:
            if not self.options.allow_hazard:
                raise TiedGradientHazard(f"gradsched refuses to run this gradient sync:\n{st.verdict}")
            warnings.warn(f"gradsched: running a graph with a known hazard (allow_hazard=True):\n{st.verdict}")

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
        return self._require_state().results

    def schedule_report(self) -> str:
        return report.schedule_report(self)

    def tied_bytes_per_step(self) -> int:
        return report.tied_bytes(self._require_state().sync_gm)


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


def _maybe_print(gm: fx.GraphModule, what: str) -> None:
    if os.environ.get("GRADSCHED_PRINT_GRAPHS"):
        print(f"==== gradsched: {what} ====\n{gm.print_readable(print_output=False)}", flush=True)
