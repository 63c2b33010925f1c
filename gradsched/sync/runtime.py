"""GradSync: the executor of one stage's gradient sync. It runs graphs; it builds none.

What it is handed:
  StageSetup   (gradsched.sync.stage_setup) the stage's groups, ties and placement, plain data;
  BuiltStage   (gradsched.sync.stage_build) the SyncPlan and the compiled graphs, built from the
               stage's backward graph when the backend compiles it (`register_backward`).

What it runs, per step:
  the backward   the plain compiled backward on every micro-batch but the last (autograd
                 accumulates in .grad); on the last, the backward graph with the reductions
                 of the buckets placed there, fed the accumulated gradients. Which backward is
                 the last is said by the driver (`step_boundary`), from the schedule, never counted;
  the flush      after the pipeline schedule has drained, the graph reducing the buckets placed
                 there (the tied ones under placement="tied_at_flush").
  B and W        under a zero-bubble schedule (cut_backward=True) each backward runs as B, the
                 inputs' gradients, returned at once (the previous stage waits for them), and W, the
                 weights' gradients, queued for the schedule to run later (`take_w`): W accumulates in
                 .grad, and the last micro-batch's W (which must run after every other) reduces.
  several stages a rank (`canonical` given): every backward of every stage graph accumulates in .grad
                 (whole, or B then W), planned over every stage graph's gradients once each has compiled
                 (rank_stages.build_union); the flush reduces the rank's buckets, but under B and W those
                 final before its last stage's W, reduced as they become so (gradsched.sync.early_reduce).

Before a graph's first collective it runs that graph's checks (gradsched.sync.preflight). The reduced
buckets of the step wait in `results` for the optimizer, which reads them through StageResults
(gradsched.sync.stage_results).
"""
from __future__ import annotations

import time

import torch
import torch.fx as fx

from gradsched.passes.verify import Verdict
from gradsched.options import SyncOptions
from gradsched.sync.preflight import check_sync_graph
from gradsched.sync.rank_stages import StagePart, build_part, build_union
from gradsched.sync.stage_build import BuiltStage, Halves, SyncGraph, build_forward, build_stage
from gradsched.sync.grad_values import accumulate, grad_or_zeros, own
from gradsched.sync.stage_results import StageResults
from gradsched.sync.stage_setup import StageSetup
from gradsched.sync.step_boundary import StepBoundary
from gradsched.sync.early_reduce import EarlyReductions
from gradsched.sync.nonfinite import StepFlags
from gradsched.sync.owners import attach, mark_sharded
from gradsched.sync.watchdog import JOURNAL


class GradSync(StageResults):
    def __init__(self, setup: StageSetup, options: SyncOptions, explicit_steps: bool = False,
                 cut_backward: bool = False, canonical: dict[str, str] | None = None):
        self.setup, self.options = setup, options
        self.cut_backward = cut_backward
        # several stages a rank: a parameter name of a stage graph -> the rank's name for it (a tie merged on the
        # rank is one Parameter under its first copy's name); None: one stage graph
        self.canonical = canonical
        self.parts: list[StagePart] = []  # several stages a rank: each stage graph's compiled backward
        self.early = EarlyReductions()  # several stages a rank, B and W: buckets reduced as their stage finishes
        self._part_w: dict[int, int] = {}  # several stages a rank: each part's W queued and not yet run
        self._handoff: list = []  # W of the backward just run, until the schedule takes it (take_w)
        self._w_outstanding = 0  # W queued and not yet run this step
        self.w_queued_max = 0  # the most W queued at once (a W ran after a later B when > 1): reports, tests
        self.built: BuiltStage | None = None
        # explicit_steps: a driver (ParallelModel.train_step) marks the last micro-batch's backward
        # with step_boundary(); without one (the backend by name), every backward ends a step
        self.explicit_steps = explicit_steps
        self._last_microbatch = False
        self.results: dict[int, torch.Tensor] = {}  # bucket index -> this step's reduced shard
        self.verdicts: dict[str, Verdict] = {}  # graph -> its verifier's verdict, once checked
        self.backward_calls = 0  # for reports and tests only: nothing is decided by counting
        self.sync_runs = 0  # steps whose gradients were reduced: once per optimizer step
        self.skipped_steps = 0  # of them, dropped by a plain torch optimizer's step under on_nonfinite="skip"
        self.flush_seconds: list[float] = []  # wall time of each flush graph run
        self.attention_reports: list = []  # ContextParallelReport of each compiled forward (cp > 1)
        self.param_shards = None  # shard="params": where the parameters live (gradsched.sync.param_shards)
        self.pending_gather = None  # shard=True: the optimizer's all-gathers in flight (finish_param_gather)
        self.nonfinite = StepFlags()  # what went non-finite this step, on the device (gradsched.sync.nonfinite)

    def step_boundary(self, last: bool) -> StepBoundary:
        """A context: backward passes run inside belong to the step's last micro-batch (last=True) or not."""
        return StepBoundary(self, last)

    def _ends_step(self) -> bool:
        return self._last_microbatch if self.explicit_steps else True

    # ---- compile time: the backend hands over the stage's graphs -------------------------------
    def register_forward(self, fw_gm: fx.GraphModule, example_inputs, names: dict[str, str],
                         params: dict[str, torch.nn.Parameter]):
        """shard="params": the forward graph gathering its parameters (`names`: placeholder -> parameter
        name); the first lays the parameters out as shards and releases their storage."""
        if self.canonical is not None:  # several stages a rank: the rank's names (a tie merged on it under one)
            names, params = self._rank_names(names), {self.canonical.get(n, n): p for n, p in params.items()}
            self._refuse_late(set(names.values()))  # before any of them is laid out as shards
        self.param_shards, forward = build_forward(fw_gm, example_inputs, names, params, self.setup, self.options,
                                                   self.param_shards, several=self.canonical is not None)
        return forward

    def _rank_names(self, names: dict) -> dict:
        return {ph: self.canonical.get(n, n) for ph, n in names.items()}

    def _refuse_late(self, names: set) -> None:
        if self.built is not None and names - set(self.built.params):
            raise RuntimeError(f"gradsched: a stage graph compiled after the rank's first step trains "
                               f"{sorted(names - set(self.built.params))}, which its plan does not hold "
                               "(a recompile after a graph break?). Compile the stages with fullgraph=True.")

    def register_backward(self, bw_gm: fx.GraphModule, example_inputs, grad_names: dict[int, str],
                          params: dict[str, torch.nn.Parameter], param_names=None, tp_sharded=frozenset()):
        """Build the stage's sync from this backward graph (gradsched.sync.stage_build); return the
        backward to run. `param_names`: forward placeholder -> parameter name (shard="params");
        `tp_sharded`: names whose Parameters are TP shards (the rest are whole, summed over TP)."""
        if self.canonical is not None:
            return self._register_part(bw_gm, example_inputs, grad_names, params, tp_sharded, param_names)
        built = build_stage(bw_gm, example_inputs, grad_names, params, self.setup, self.options, self.built,
                            self.param_shards, param_names, zero_bubble=self.cut_backward, tp_sharded=tp_sharded)
        self.built = built
        attach(self, params.values())
        if self.options.shard:
            mark_sharded(params.values())
        sg = built.graphs.get("backward")

        shards = (lambda: self.param_shards.inputs(built.param_inputs)) if built.param_inputs else list

        def plain(args):  # earlier micro-batches (or every one, with nothing to reduce here): autograd accumulates
            self.backward_calls += 1
            if built.plain_halves is not None:
                rec = built.plain_halves.record
                return self._defer_w(built.plain_halves, list(args) + shards(),
                                     len(rec.input_outputs) + len(rec.weight_outputs),
                                     lambda grads: accumulate(grads, built.grad_names, params))
            return built.plain(list(args) + shards())
        plain._boxed_call = True
        if sg is None:
            return plain

        def backward(args):
            if not self._ends_step():
                return plain(args)
            self.backward_calls += 1
            self._check_once(sg)
            record = sg.record
            if sg.halves is not None:
                return self._defer_w(sg.halves, list(args) + shards(), record.n_outputs,
                                     lambda grads: self._reduced(sg, grads, params),
                                     lambda: [grad_or_zeros(params[n]) for n in record.acc_inputs])
            acc = [grad_or_zeros(params[n]) for n in record.acc_inputs]
            outs = list(sg.fn(list(args) + shards() + acc))
            for n in record.acc_inputs:
                params[n].grad = None  # consumed: the reduced gradient replaces it
            self.results.update(zip((b.index for b in sg.layout.buckets), outs[record.n_outputs:]))
            if "flush" not in built.graphs:
                self.sync_runs += 1
            return outs[:record.n_outputs]
        backward._boxed_call = True
        return backward

    def _register_part(self, bw_gm, example_inputs, grad_names: dict[int, str], params: dict, tp_sharded=frozenset(),
                       param_names=None):
        """One stage graph of a rank of several: compiled now; the rank's plan waits for the flush."""
        name = lambda n: self.canonical.get(n, n)  # noqa: E731
        grad_names, tp_sharded = {i: name(n) for i, n in grad_names.items()}, frozenset(map(name, tp_sharded))
        params = {name(n): p for n, p in params.items()}
        self._refuse_late(set(params))
        part = build_part(bw_gm, example_inputs, grad_names, params, self.setup, self.options, self.cut_backward,
                          tp_sharded, self.param_shards, self._rank_names(param_names or {}))
        shards = (lambda: self.param_shards.inputs(part.param_inputs)) if part.param_inputs else list
        index = next(  # a stage graph compiled again keeps its place in the order the parts finish
            (i for i, q in enumerate(self.parts) if q.params.keys() == params.keys()), len(self.parts))
        self.parts.append(part)
        attach(self, params.values())
        if self.options.shard:
            mark_sharded(params.values())

        def finish(grads, last: bool):
            accumulate(grads, part.grad_names, params)
            self._part_w[index] -= 1
            if last:  # this part's gradients are final: early reductions of its point go now
                if self._part_w[index]:
                    raise RuntimeError(f"gradsched: a stage's last weight gradients (W) ran with {self._part_w[index]} "
                                       "of its other W still to run: the schedule must run each stage's W in order.")
                self.early.finished(self, index)

        def backward(args):
            self.backward_calls += 1
            if part.plain_halves is not None:
                rec, last = part.plain_halves.record, self._ends_step()
                self._part_w[index] = self._part_w.get(index, 0) + 1
                return self._defer_w(part.plain_halves, list(args) + shards(),
                                     len(rec.input_outputs) + len(rec.weight_outputs), lambda grads: finish(grads, last))
            return part.plain(list(args) + shards())
        backward._boxed_call = True
        return backward

    # ---- B now, W later (a zero-bubble schedule) ----------------------------------------------
    def _defer_w(self, fns: Halves, args: list, n_outputs: int, finish, late=list) -> list:
        """Run B on `args` (the graph's inputs but those `late` gives when W runs: the gradients accumulated
        so far); queue W, whose outputs (position -> gradient) go to `finish`. Returns the backward's first
        `n_outputs` outputs: the inputs' gradients, None where W's will be (autograd accumulates nothing)."""
        rec = fns.record
        res = list(fns.b([args[i] for i in rec.b_inputs]))
        n = len(rec.input_outputs)
        out = [None] * n_outputs
        for i, v in zip(rec.input_outputs, res[:n]):
            out[i] = v
        stash, n_args = res[n:], len(args)
        kept = {i: args[i] for i in rec.w_inputs if i < n_args}  # only what W reads stays alive (not `args`)

        def w():
            try:
                full = {**kept, **dict(enumerate(late(), start=n_args))}
                ins = stash + [full[i] for i in rec.w_inputs]
                with torch.no_grad():  # as inside autograd's backward: saved inputs may require grad
                    outs = own(fns.w(ins), ins)
                finish(dict(zip(rec.weight_outputs, outs)))
            finally:
                self._w_outstanding -= 1
        self._handoff.append(w)
        self._w_outstanding += 1
        self.w_queued_max = max(self.w_queued_max, self._w_outstanding)
        return out

    def begin_step(self) -> None:
        """A step starts: nothing queued from a step that failed part way (its W never ran, and never will)."""
        self._handoff.clear()
        self._w_outstanding = 0
        self._part_w.clear()
        self.early.reset(planned=self.built is not None)

    def take_w(self):
        """The W of the backward just run (the schedule's dw_builder): a callable to run when the schedule
        says. Every W queued since the last take (a stage of several graphs queues one each), in order; a
        no-op when none was (nothing of that backward needed a gradient)."""
        taken, self._handoff = self._handoff, []

        def run():
            for w in taken:
                w()
        return run

    def drop_w(self) -> None:
        """Forget the W of backwards whose results are not the model's (pipelining's shape inference)."""
        self._w_outstanding -= len(self._handoff)
        self._handoff.clear()
        self._part_w.clear()  # (shape inference runs before any of the step's own backward)

    def _reduced(self, sg: SyncGraph, grads: dict, params: dict) -> None:
        """The last micro-batch's W has run: its reductions are the step's."""
        if self._w_outstanding != 1:  # it read the accumulated gradients: every other W must be in them
            raise RuntimeError(f"gradsched: the last micro-batch's weight gradients (W) ran with {self._w_outstanding - 1}"
                               " other W still to run: the schedule must run each stage's W in micro-batch order.")
        record = sg.record
        for n in record.acc_inputs:
            params[n].grad = None  # consumed: the reduced gradient replaces it
        accumulate({i: g for i, g in grads.items() if i < record.n_outputs}, self.built.grad_names, params)
        buckets = [grads[i] for i in sorted(grads) if i >= record.n_outputs]
        self.results.update(zip((b.index for b in sg.layout.buckets), buckets))
        if "flush" not in self.built.graphs:
            self.sync_runs += 1

    # ---- the flush ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Reduce what waits for the end of the step (every bucket under placement='flush', the tied
        ones under 'tied_at_flush'); call once per step, after the schedule. Nothing to do otherwise."""
        if self._w_outstanding:
            raise RuntimeError(f"gradsched: the step ended with {self._w_outstanding} weight-gradient (W) "
                               "computations never run: the schedule must run every W it queued.")
        if self.built is None and self.setup.placement == "backward":
            return
        if self.built is None and self.parts:  # several stages a rank: every stage graph has compiled by now
            distinct = len({frozenset(q.params) for q in self.parts})  # (a recompiled stage graph counts once)
            self.built = build_union(self.parts, self.setup, self.options, self.early.order(distinct), self.param_shards)
            self.early.catch_up(self)
        built = self._require_built()
        if built.order and self.early.done != len(built.order):
            raise RuntimeError(f"gradsched: {self.early.done} of pipeline rank {self.setup.stage}'s "
                               f"{len(built.order)} stage graphs finished this step's W: the schedule must run them all.")
        sg, t0 = built.graphs.get("flush"), time.perf_counter()
        if sg is None and not built.order:
            return
        if sg is not None:
            self._check_once(sg)
            grads = [built.params[n] for n in sg.inputs]
            with JOURNAL.entry(f"the flush graph of stage {self.setup.stage} (tied all-reduce, then the reduction "
                               f"of buckets {[b.index for b in sg.layout.buckets]})"):
                outs = list(sg.fn([grad_or_zeros(p) for p in grads]))
            self.results.update(zip((b.index for b in sg.layout.buckets), outs if built.plan.shard else outs[len(grads):]))
            for i, p in enumerate(grads):  # shard: the shards are the gradients now (.grad would be stale); else
                p.grad = None if built.plan.shard else outs[i]  # each .grad is its view of the reduced bucket
        self.early.wait(self.results)
        self.flush_seconds.append(time.perf_counter() - t0)  # the step's tail after the schedule (benchmarks)
        self.sync_runs += 1

    def _check_once(self, sg: SyncGraph) -> None:
        if sg.where not in self.verdicts:
            b = self.built
            self.verdicts[sg.where] = check_sync_graph(self.setup, b.plan, sg, b.params, self.options)
