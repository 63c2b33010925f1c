"""The pipeline's schedule: torch.distributed.pipelining's stage and schedule classes, run with gradsched's graphs.

    "gpipe", "1f1b"   Schedule1F1B / ScheduleGPipe over the compiled stage module: each backward is one
                      compiled graph (the last micro-batch's with its reductions)
    "zb1p"            ScheduleInterleavedZeroBubble (ZB-H1, arXiv 2401.10241): each backward runs as B, the
                      inputs' gradients, at once, and W, the weights', where the schedule puts it (in the
                      bubble). B and W are gradsched's compiled halves of the backward graph
                      (passes/cut_backward.py, gradsched.sync.runtime); torch's own split runs eager
                      autograd twice and refuses compiled stages. stages_per_rank stages a rank (looped)
    "interleaved_1f1b" ScheduleInterleaved1F1B (Megatron's virtual stages): stages_per_rank (>= 2) stages a
                      rank, looped (rank r holds r, r + pp, ...)
    "zbv"             ScheduleZBVZeroBubble: two stages a rank in a V (rank r holds r and 2 pp - 1 - r: the
                      first and the last on rank 0, a tie between them one Parameter), B and W as zb1p's
    "dualpipev"       ScheduleDualPipeV (DeepSeek's DualPipe, as a V): zbv's assignment of stages; a forward of one
                      micro-batch beside a whole backward of another in its middle phase, each run in turn
                      (overlapping their compute and communication is left to the device: one stream here)

The stage tells the gradient sync which backward is the step's last and notes what it sends on the device
(gradsched.sync.nonfinite).
"""
from __future__ import annotations

import contextlib
import time

import torch.nn as nn

from gradsched.sync import nonfinite

SCHEDULES = ("auto", "1f1b", "gpipe", "zb1p", "interleaved_1f1b", "zbv", "dualpipev")
CUT_BACKWARD = ("zb1p", "zbv", "dualpipev")  # schedules that run each backward as B and W (gradsched.sync.runtime)
MULTI_STAGE = ("zb1p", "interleaved_1f1b", "zbv", "dualpipev")  # schedules that take several stages a rank
V_SHAPED = ("zbv", "dualpipev")  # two stages a rank in a V: rank r holds stages r and 2 pp - 1 - r


_OFF = contextlib.nullcontext()


class Timeline:
    """When `on`, the stage's work as (kind, micro-batch, start, end) in time.perf_counter() seconds: "F" a
    forward (with the loss on the last stage), "B" an inputs' backward ("BW" a whole one), "W" a weights'
    backward, "sync" the flush. benchmarks/pipeline.py measures the bubble from it and draws it."""
    def __init__(self):
        self.on, self.events = False, []

    def span(self, kind: str, microbatch: int = -1):
        # off (every step but a benchmark's): one shared no-op context, not a generator a micro-batch
        return self._span(kind, microbatch) if self.on else _OFF

    @contextlib.contextmanager
    def _span(self, kind: str, microbatch: int):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((kind, microbatch, t0, time.perf_counter()))


def pipeline_schedule(name: str, stages: list, num_stages: int, plan, sync, m: int, device, loss_fn,
                      timeline: Timeline | None = None):
    """The schedule object (its .step runs one training step) for this rank's stages: `stages` holds (stage
    index, the compiled stage, the module it compiles) for each, `num_stages` the pipeline's, `sync` the rank's
    GradSync, `m` micro-batches."""
    timeline = timeline or Timeline()
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)
    split = name in CUT_BACKWARD

    class Stage(PipelineStage):
        # the schedule says which backward is the step's last (never counted: pipelining
        # runs an extra shape-inference backward on its first step). A zero-bubble schedule marks only
        # the last W: the backward (B) of the last micro-batch is the one that builds the reductions
        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            with sync.step_boundary(last=bwd_chunk_id == m - 1 if split else last_backward), \
                    timeline.span("B" if split and not full_backward else "BW", bwd_chunk_id):
                out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            if not self.is_first:  # what it sends back: noted on the device, never read here
                sync.nonfinite.observe(nonfinite.BACKWARD, self.bwd_cache.get(bwd_chunk_id))
            return out

        # pipelining infers shapes on its first step by running the stage (and the loss) on empty tensors:
        # whatever they hold is no value of the model's, and is not checked
        def _forward_metadata_inference(self, *args, **kwargs):
            with sync.nonfinite.paused():
                return super()._forward_metadata_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args, **kwargs):
            with sync.nonfinite.paused():
                out = super()._backward_metadata_inference(*args, **kwargs)
            sync.drop_w()  # its gradients are of empty tensors, never the model's
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with timeline.span("W", bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

        def _retrieve_recv_activations(self, fwd_chunk_id):
            out = super()._retrieve_recv_activations(fwd_chunk_id)
            prev = self.stage_index_to_group_rank[self.stage_index - 1]
            if prev != self.group_rank:  # over a boundary (a V's turn on one rank is handed over in memory)
                sender = plan.rank_of(prev, plan.index("dp"), plan.index("cp"), plan.index("tp"))
                sync.nonfinite.observe_received(nonfinite.transit_code(self.stage_index, fwd_chunk_id, sender), out)
            return out

        def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, *rest, **kw):
            with timeline.span("F", fwd_chunk_id):
                out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, *rest, **kw)
            if not self.is_last:  # what it sends on (the last stage's output is checked as its loss)
                sync.nonfinite.observe(nonfinite.FORWARD, out)
            return out

    group = plan.process_group("pp")
    # dw_builder: the W that gradsched's backward queued (its compiled W graph), run when the schedule says
    built = [Stage(_CompiledStage(module, compiled), index, num_stages, device, group=group, dw_builder=sync.take_w)
             if split else Stage(compiled, index, num_stages, device, group=group)
             for index, compiled, module in stages]
    if name in ("1f1b", "gpipe"):
        return _indexed(Schedule1F1B if name == "1f1b" else ScheduleGPipe)(built[0], n_microbatches=m,
                                                                            loss_fn=loss_fn, scale_grads=False)
    cls = {"zb1p": ScheduleInterleavedZeroBubble, "interleaved_1f1b": ScheduleInterleaved1F1B,
           "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[name]
    return _indexed(cls)(built, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)


def _indexed(cls):
    """`cls` calling its loss_fn(output, target, index) with the micro-batch's index (pipelining's own loss_fn
    takes two arguments): the step's loss weights are computed once for all micro-batches."""
    class Indexed(cls):
        def _compute_loss(self, output, target, loss_kwargs=None):
            return self._loss_fn(output, target, self._loss_index, **(loss_kwargs or {}))

        def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
            self._loss_index = mb_index
            try:
                return super()._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)
            finally:
                self._loss_index = None
    Indexed._loss_index = None
    Indexed.__name__ = cls.__name__
    return Indexed


class _CompiledStage(nn.Module):
    """A stage module run compiled, with the compiled wrapper kept out of the module tree. torch's zero-bubble
    schedules refuse a stage that holds a torch.compile'd module: their split backward would run autograd
    through the compiled graph twice. gradsched's backward runs its own B and W graphs instead (dw_builder)."""
    def __init__(self, stage_module: nn.Module, compiled):
        super().__init__()
        self.stage = stage_module
        self.__dict__["compiled"] = compiled

    def forward(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)


def least_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches `schedule` runs at `pp` (resolve_schedule's bounds): the dry run's default."""
    return {"zbv": 2 * pp - 1, "dualpipev": 2 * pp}.get(schedule, pp)


def resolve_schedule(schedule: str, pp: int, m: int) -> str:
    """The schedule that runs ("auto": 1F1B with micro-batches >= pp, else GPipe; at pp 1 each micro-batch's
    forward then its backward, as 1F1B orders one stage), or ValueError saying what to change; found from the
    sizes alone, before any collective (gradsched.train checks it before connecting)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: gradsched runs {SCHEDULES} from torch.distributed.pipelining.")
    if pp == 1 and schedule not in MULTI_STAGE:  # no pipeline: each micro-batch's forward, then its backward
        return "1f1b"
    if schedule == "auto":
        return "1f1b" if m >= pp else "gpipe"
    if schedule in ("1f1b", "zb1p") and m < pp:
        raise ValueError(f"the {schedule} schedule needs at least as many micro-batches as pipeline stages ({m} < "
                         f"pp {pp}): use the gpipe schedule, or {pp} micro-batches or more.")
    if schedule in MULTI_STAGE and pp == 1:
        raise ValueError(f"{schedule} is a pipeline schedule: with pp 1 there is no pipeline, and the backward "
                         "runs whole. Leave the schedule out, or split the model (pp > 1).")
    if schedule == "zbv" and m < 2 * pp - 1:
        raise ValueError(f"the zbv schedule needs at least 2 pp - 1 = {2 * pp - 1} micro-batches to fill its V "
                         f"(got {m}): use {2 * pp - 1} or more, or another schedule.")
    if schedule == "dualpipev" and m < 2 * pp:
        raise ValueError(f"the dualpipev schedule needs at least as many micro-batches as stages, 2 pp = {2 * pp} "
                         f"(got {m}): use {2 * pp} or more, or another schedule.")
    if schedule in ("zb1p", "interleaved_1f1b"):
        rounds = max(1, m // pp)  # torch's ZB-H1 and interleaved 1F1B run micro-batches in rounds of at least pp
        if m % rounds:
            raise ValueError(f"the {schedule} schedule with pp {pp} runs micro-batches in {rounds} rounds of equal "
                             f"size: {m} micro-batches do not divide into them. Use a multiple of {pp} (e.g. "
                             f"{rounds * pp}).")
    return schedule


def stage_assignment(schedule: str, stages_per_rank: int | None) -> tuple[int, str]:
    """(stages a rank, their placement: "loop" or "v"; gradsched.training.virtual_stages) for a resolved
    schedule, or ValueError saying what to change."""
    if schedule in V_SHAPED:
        if stages_per_rank not in (None, 2):
            raise ValueError(f"the {schedule} schedule holds two stages a rank (a V), not stages_per_rank={stages_per_rank}: "
                             "leave stages_per_rank out, or use interleaved_1f1b or zb1p for another number.")
        return 2, "v"
    v = stages_per_rank if stages_per_rank is not None else (2 if schedule == "interleaved_1f1b" else 1)
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank!r}: a whole number of stages, 1 or more.")
    if v > 1 and schedule not in MULTI_STAGE:
        raise ValueError(f"stages_per_rank={v} needs a schedule that runs several stages a rank {MULTI_STAGE}, "
                         f"not {schedule!r}.")
    if schedule == "interleaved_1f1b" and v < 2:
        raise ValueError("interleaved_1f1b interleaves stages_per_rank >= 2 stages a rank (1 is plain 1f1b).")
    return v, "loop"


def schedule_order(stage: int, pp: int, m: int, schedule: str) -> list[tuple[str, int]]:
    """The stage's forwards ("F", i) and backwards ("B", i) in the order torch's schedule runs them: GPipe
    all forwards first; 1F1B min(m, pp - stage) forwards, then one backward and one forward in turn; zero bubble
    (ZB-H1) torch's own order, its backwards split into ("B", i), the inputs' gradients, and ("W", i), the weights'."""
    if schedule in CUT_BACKWARD:
        return _zero_bubble_order(stage, pp, m)
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, pp - stage)
    order = [("F", i) for i in range(warm)]
    for i in range(m):
        order.append(("B", i))
        if i + warm < m:
            order.append(("F", i + warm))
    return order


def _zero_bubble_order(stage: int, pp: int, m: int) -> list[tuple[str, int]]:
    """ScheduleInterleavedZeroBubble's action list for this stage (one stage a rank): only its order."""
    return [("B" if kind == "BW" else kind, i) for kind, _, i in rank_actions("zb1p", stage, pp, 1, m)]


def rank_actions(schedule: str, rank: int, pp: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) in the order torch's schedule runs them on `rank`, from the schedule class's own
    per-rank arithmetic (no stage or process group built): "F", "B" (the inputs' gradients under B and W, or the
    whole backward), "W", and "BW" a whole backward under B and W (DualPipeV's; its overlapped pairs in order)."""
    from torch.distributed.pipelining import schedules as S
    C = S._ComputationType
    cls = {"zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV,
           "interleaved_1f1b": S.ScheduleInterleaved1F1B, "zb1p": S.ScheduleInterleavedZeroBubble}[schedule]
    order = object.__new__(cls)
    order.pp_group_size, order.n_local_stages, order._n_microbatches, order.rank = pp, v, m, rank
    order.num_stages = order._num_stages = pp * v
    order.number_of_rounds = max(1, m // pp)
    order.microbatches_per_round = m // order.number_of_rounds
    split = schedule in CUT_BACKWARD
    kinds = {C.FORWARD: "F", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W", C.FULL_BACKWARD: "BW" if split else "B"}
    out = []
    for a in order._calculate_single_rank_operations(rank):
        for b in (a.sub_actions if a is not None and a.computation_type == C.OVERLAP_F_B else (a,)):
            if b is not None:
                out.append((kinds[b.computation_type], b.stage_index, b.microbatch_index))
    return out
