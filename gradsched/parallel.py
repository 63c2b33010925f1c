"""parallelize: a model, a plan and options in; a trainable parallel model out.

    @gradsched.parallelize(plan=plan, loss_fn=lm_loss, microbatches=4)
    class MyGPT(nn.Module): ...

    model = gradsched.parallelize(MyGPT(), plan=plan, loss_fn=lm_loss)   # or on an instance
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = model.train_step(inputs, targets); opt.step()

pp > 1 splits the model with torch.distributed.pipelining (`split_points`:
module names that begin a new stage) and runs its GPipe or 1F1B schedule;
each stage is compiled with the gradsched backend and its tied copies are
found from the split (or from `ties=` as an override).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .backend import gradsched_backend
from .options import SyncOptions
from .plan import ParallelPlan
from .runtime import GradSync
from .ties import shared_parameters, ties_from_override, ties_from_pipe

SCHEDULES = ("auto", "1f1b", "gpipe")


class ParallelModel:
    def __init__(self, model: nn.Module, plan: ParallelPlan, loss_fn, split_points=(), schedule="auto",
                 ties=None, fullgraph=True, **options):
        if plan.pp > 1 and len(split_points) != plan.pp - 1:
            raise ValueError(f"pp={plan.pp} needs {plan.pp - 1} split_points (module names that begin a "
                             f"stage, e.g. ['blocks.1']), got {list(split_points)}.")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: gradsched runs {SCHEDULES} from torch.distributed.pipelining.")
        self.model, self.plan, self.loss_fn = model, plan, loss_fn
        self.options = SyncOptions.from_dict(options)
        m = self.options.microbatches
        if schedule == "auto":
            schedule = "1f1b" if m >= plan.pp else "gpipe"
        if schedule == "1f1b" and m < plan.pp:
            raise ValueError(f"schedule='1f1b' needs microbatches >= pp ({m} < {plan.pp}): use schedule='gpipe', "
                             f"or microbatches={plan.pp} or more.")
        self.split_points, self.schedule_name, self.tie_override = list(split_points), schedule, ties
        self.fullgraph = fullgraph
        self.within_module_ties = shared_parameters(model)
        self.grad_sync = None
        self.module = None
        if plan.pp == 1:
            self._build(ties=[], stage_module=model)

    def _build(self, ties, stage_module):
        self.grad_sync = GradSync(self.plan, self.options, ties)
        self.ties = ties
        self.stage_module = stage_module
        self.module = torch.compile(stage_module, fullgraph=self.fullgraph,
                                    backend=functools.partial(gradsched_backend, grad_sync=self.grad_sync))

    def _shard_sequence(self, inputs, targets):
        """Model inputs as a tuple; under context parallelism, this rank's slice of the sequence.

        The model then gets (tokens, positions): each rank holds non-contiguous chunks, so
        positions must come in explicitly (learned or rotary embeddings read them).
        """
        if self.plan.cp == 1:
            return (inputs,), targets
        from .cp_layout import shard
        cp, (_, _, r), lb = self.plan.cp, self.plan.coords(), self.options.load_balance
        pos = torch.arange(inputs.shape[1]).expand(inputs.shape[:2])
        return (shard(inputs, cp, r, 1, lb), shard(pos, cp, r, 1, lb)), shard(targets, cp, r, 1, lb)

    def _build_pipeline(self, microbatch: tuple):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline
        # Trace under no_grad: a module whose forward is itself decorated with no_grad (HF's
        # rotary embedding) otherwise becomes a wrap_with_set_grad_enabled op that export's
        # unflattener turns into a call with no arguments. The stages still run under
        # autograd; only the trace is affected.
        with torch.no_grad():
            pipe = pipeline(self.model, mb_args=microbatch,
                            split_spec={name: SplitPoint.BEGINNING for name in self.split_points})
        ties = ties_from_override(self.tie_override) if self.tie_override is not None else ties_from_pipe(pipe)
        self._build(ties, pipe.get_stage_module(self.plan.stage))
        stage = PipelineStage(self.module, self.plan.stage, self.plan.pp, torch.device("cpu"),
                              group=self.plan.process_group("pp"))
        m = self.options.microbatches

        def scaled_loss(out, target):  # each micro-batch carries 1/m of the step's mean loss
            return self.loss_fn(out, target) / m
        cls = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
        self.schedule = cls(stage, n_microbatches=m, loss_fn=scaled_loss, scale_grads=False)

    def train_step(self, inputs, targets):
        """Forward and backward over this rank's batch (split into micro-batches), gradients reduced.

        Returns this rank's mean loss over its batch (None on pipeline stages without the loss).
        """
        try:
            return self._train_step(inputs, targets)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise e.inner_exception from None  # gradsched's own error, not Dynamo's wrapper

    def _train_step(self, inputs, targets):
        m = self.options.microbatches
        if inputs.shape[0] % m:
            raise ValueError(f"batch of {inputs.shape[0]} does not split into microbatches={m}.")
        inputs, targets = self._shard_sequence(inputs, targets)
        if self.plan.pp == 1:
            total = 0.0
            for x, y in zip(zip(*(t.chunk(m) for t in inputs)), targets.chunk(m)):
                loss = self.loss_fn(self.module(*x), y) / m
                loss.backward()
                total += loss.detach()
            return total
        if self.module is None:
            self._build_pipeline(tuple(t.chunk(m)[0] for t in inputs))
        first, last = self.plan.stage == 0, self.plan.stage == self.plan.pp - 1
        losses = []
        self.schedule.step(*(inputs if first else ()), **({"target": targets, "losses": losses} if last else {}))
        self.grad_sync.flush()
        return sum(loss.detach() for loss in losses) if last else None

    def named_parameters(self):
        return (self.stage_module if self.module is not None else self.model).named_parameters()

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def schedule_report(self) -> str:
        return self.grad_sync.schedule_report()


def parallelize(model=None, *, plan: ParallelPlan, loss_fn, **kwargs):
    """Make a model (instance or class) train under `plan`; usable as a decorator."""
    if model is None:
        return functools.partial(parallelize, plan=plan, loss_fn=loss_fn, **kwargs)
    if isinstance(model, type):
        @functools.wraps(model, updated=())
        def build(*args, **kw):
            return ParallelModel(model(*args, **kw), plan, loss_fn, **kwargs)
        return build
    return ParallelModel(model, plan, loss_fn, **kwargs)
