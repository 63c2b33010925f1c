"""One training step of a parallel model: the micro-batches through this rank's stage(s), gradients reduced.

One stage (pp = 1): each micro-batch's forward and weighted loss in the stage's compiled graph, autograd
accumulating, the last micro-batch's backward reducing. A pipeline (pp > 1): torch.distributed.pipelining's
schedule over gradsched's compiled stages. Either way the GradSync's flush ends the step and the global batch's
loss comes back (gradsched.training.global_loss).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from gradsched.sync.watchdog import JOURNAL, is_comm_error
from gradsched.training.vocab_parallel_loss import VocabParallelLoss
from gradsched.training.global_loss import GlobalLoss
from gradsched.training.pipeline_schedule import Timeline
from gradsched.training.model_state import ModelState
from gradsched.user_errors import in_stage, name_model_line, own_error


@contextlib.contextmanager
def step_errors(step: int):
    """Around a whole step: its entry in the journal, and gradsched's own error raised, not the wrapper Dynamo or
    pipelining put around it."""
    try:
        # the first step traces and compiles (Dynamo's trace before the backend included): peers waiting for it
        # meanwhile give it compile_timeout_s (gradsched.sync.stuck)
        with JOURNAL.entry(f"train_step {step}: the stage's schedule (forward, backward, CP and p2p collectives in "
                           "its compiled graphs)", "compile" if step == 1 else "phase"):
            yield
    except Exception as e:
        own = own_error(e)
        if own is None or own is e:
            raise
        raise own from None


class StepDriver:
    """A parallel model's steps: each one's checks, its micro-batches through this rank's stage(s), the flush that
    ends it, and the global batch's loss. Collectives go out in the same order on every rank: the loss's
    begin (last stage), the pipeline's construction (its first step), the schedule, the flush."""

    def __init__(self, state: ModelState, values, plan, options, loss_fn, ignore_index: int, num_stages: int):
        self.state, self.values, self.plan, self.loss_fn, self.num_stages = state, values, plan, loss_fn, num_stages
        self.m, self.compiler = options.microbatches, options.compiler
        split = VocabParallelLoss(loss_fn, plan, options.compiler) if plan.pp > 1 and plan.tp > 1 else None
        self.global_loss = GlobalLoss(loss_fn, plan, options.average, ignore_index,
                                      options.compiler if plan.pp > 1 else "eager", split)
        self.timeline = Timeline()  # the schedule's work per micro-batch, when timeline.on (benchmarks/pipeline.py)
        self.shape_check = ShapeCheck(plan.pp, self.m)
        self.loss_in_graph = None  # pp = 1: whether the loss runs in the stage's graph (the first micro-batch says)
        self.steps = 0

    def run(self, inputs: tuple, targets, built, schedule, build_pipeline):
        """One step over this rank's (sequence-sharded) batch; `build_pipeline(microbatch) -> (built, schedule)`
        builds a pipeline at its first step."""
        m, state = self.m, self.state
        last_stage = self.num_stages - 1 in state.local
        if self.plan.pp > 1:
            self.shape_check(inputs, targets)
        if last_stage:
            self.global_loss.begin(targets, m)
        issued = None
        if self.plan.pp == 1:
            self.values.ready(state.stage_module, inputs[0].device)
            losses, issued = self._one_stage(built, inputs, targets)
        else:
            if built is None:
                built, schedule = build_pipeline(tuple(t.chunk(m)[0] for t in inputs))
            losses = self._pipeline(schedule, inputs, targets, last_stage)
        with self.timeline.span("sync"):
            state.grad_sync.flush()
        return self.global_loss.end(state.grad_sync, losses if last_stage else None, issued)

    def _one_stage(self, built, inputs: tuple, targets) -> tuple[list, object]:
        """pp = 1: the step's micro-batches, the last one's backward reducing; returns their losses."""
        losses, issued, m, sync = [], None, self.m, self.state.grad_sync
        with stage_errors(self.state, self.compiler):
            for i, (x, y) in enumerate(zip(zip(*(t.chunk(m) for t in inputs)), targets.chunk(m))):
                loss = self._microbatch_loss(built, x, y, i)
                losses.append(loss.detach())
                if i < m - 1:  # autograd accumulates (GradSync's step boundary is off between steps)
                    loss.backward()
                    continue
                issued = self.global_loss.issue(sync, losses)  # hidden by the backward (shard=False)
                with sync.step_boundary(last=True):
                    loss.backward()
        return losses, issued

    def _pipeline(self, schedule, inputs: tuple, targets, last_stage: bool) -> list:
        """pp > 1: one run of the schedule; returns the last stage's micro-batch losses (empty elsewhere)."""
        losses = []
        self.state.grad_sync.begin_step()
        with stage_errors(self.state, self.compiler):
            # return_outputs=False: the last stage would keep every micro-batch's logits to the next step
            schedule.step(*(inputs if 0 in self.state.local else ()), return_outputs=False,
                          **({"target": targets, "losses": losses} if last_stage else {}))
        return losses

    def _microbatch_loss(self, built, x, y, i: int):
        """Micro-batch i's weighted loss, computed in the stage's compiled graph (its forward and backward then run
        no eager op of the loss's); a loss_fn Dynamo cannot trace whole (fullgraph) runs eagerly after the stage's
        graph instead, with a warning."""
        if self.loss_in_graph is not False:
            try:
                loss = built.loss_step(self.loss_fn, x, y, *self.global_loss.gate(i, y.device))
                self.loss_in_graph = True
                return loss
            except torch._dynamo.exc.Unsupported as e:
                if self.loss_in_graph:
                    raise
                self.loss_in_graph = False  # nothing ran: Dynamo refuses before any graph is compiled
                why = str(e).splitlines()[0]
                warnings.warn(f"gradsched: loss_fn could not be compiled into the stage's graph ({why}"
                              "); it runs eagerly after the stage's graph, op by op (more host time per micro-batch). "
                              "Make it traceable by torch.compile(fullgraph=True) to remove that.", stacklevel=5)
        return self.global_loss(built.module(*x), y, i)


@contextlib.contextmanager
def stage_errors(state: ModelState, compiler: str):
    """An error of the model's code while its stage runs names the model's line, not the generated code of the
    stage's graph or the wrappers of Dynamo and pipelining."""
    try:
        yield
    except Exception as e:
        own = own_error(e)
        if own is not None:
            name_model_line(own, state.stage_module)  # a pass's refusal in a stage's graph: the model's line too
            raise
        plan = state.plan
        stage = f"pipeline stage {plan.stage} of {plan.pp}" if plan.pp > 1 else "the training step"
        if is_comm_error(e):
            raise  # another rank stopped: the journal's entry names which (gradsched.sync.watchdog)
        raise in_stage(f"{stage} failed in the model's code", e, state.stage_module, compiler) from e


class ShapeCheck:
    """pipelining fixes every stage's shapes at the split and its first step: other shapes are refused on this rank
    before anything is sent (a stage would fail mid-schedule)."""

    def __init__(self, pp: int, m: int):
        self.pp, self.m, self.shapes = pp, m, None

    def __call__(self, inputs: tuple, targets) -> None:
        shapes = ([tuple(t.chunk(self.m)[0].shape) for t in inputs], tuple(targets.chunk(self.m)[0].shape))
        if self.shapes is None:
            self.shapes = shapes
        elif shapes != self.shapes:
            raise ValueError(
                f"pp={self.pp}: the pipeline stages were split and shaped for micro-batches of inputs "
                f"{self.shapes[0]} and targets {self.shapes[1]} (the first step's), but this step's are "
                f"{shapes[0]} and {shapes[1]}. Under pp > 1 keep the batch size, microbatches and sequence "
                "length the same every step (pad sequences to one length), or train with pp=1.")


def check_divides(batch: int, m: int) -> None:
    if batch % m:
        raise ValueError(f"batch of {batch} does not split into microbatches={m}.")
