"""parallelize: a model, a plan and options in; a trainable parallel model out.

    @gradsched.parallelize(plan=plan, loss_fn=lm_loss, microbatches=4)
    class MyGPT(nn.Module): ...

    model = gradsched.parallelize(MyGPT(), plan=plan, loss_fn=lm_loss)   # or on an instance
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = model.train_step(inputs, targets); opt.step()

ParallelModel holds the plan, the options and what was built; training/'s pipeline_build builds, step_driver
steps, model_state holds names and state (how the optimizer and checkpoints see it).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from gradsched.backend import gradsched_backend
from gradsched.cp.layout import model_inputs
from gradsched.options import SyncOptions
from gradsched.plan import ParallelPlan
from gradsched.sync.watchdog import configure as configure_watchdog
from gradsched.training import pipeline_build as build, step_driver as driver
from gradsched.training.model_state import ModelState
from gradsched.training.pipeline_schedule import resolve_schedule, stage_assignment
from gradsched.training.stage_values import StageValues
from gradsched.training.virtual_stages import local_stages


class ParallelModel:
    def __init__(self, model: nn.Module, plan: ParallelPlan, loss_fn, split_points=(), schedule="auto",
                 ties=None, fullgraph=True, ignore_index=-100, init_weights=None, init_seed=0, stages_per_rank=None,
                 **options):
        self.model, self.plan, self.loss_fn, self.tie_override = model, plan, loss_fn, ties
        self.options = opts = SyncOptions.from_dict(options)
        schedule = resolve_schedule(schedule, plan.pp, opts.microbatches)
        v, style = stage_assignment(schedule, stages_per_rank)
        self.staging = build.Staging(schedule, v, style, tuple(split_points), plan.pp * v)
        build.check_options(model, plan, opts, self.staging, fullgraph)
        self.fullgraph, self.ignore_index = fullgraph, ignore_index
        self.values = StageValues(model, plan, init_weights, init_seed)  # a model on meta: allocated at step 1
        self.model_state = ModelState(model, plan, opts, local_stages(plan.stage, plan.pp, v, style))
        self.built = self.schedule = None
        configure_watchdog(plan.describe() if torch.distributed.is_initialized() and plan.world > 1 else "",
                           opts.fault_timeout_s, opts.compile_timeout_s)
        self.driver = driver.StepDriver(self.model_state, self.values, plan, opts, loss_fn, ignore_index,
                                        self.staging.num_stages)
        if plan.pp == 1:
            self.built = build.compile_unsplit(self.model_state, self.staging, self._compile_with)
            self.values.make_replicas_equal(self.model)

    # what was built, and how it is cut (the dry run, the entry point and benchmarks read these)
    schedule_name = property(lambda self: self.staging.schedule)
    stages_per_rank = property(lambda self: self.staging.stages_per_rank)
    num_stages = property(lambda self: self.staging.num_stages)
    split_points = property(lambda self: list(self.staging.split_points))
    local = property(lambda self: self.model_state.local)
    within_module_ties = property(lambda self: self.model_state.within_module_ties)
    grad_sync = property(lambda self: self.model_state.grad_sync)
    ties = property(lambda self: self.model_state.ties)
    stage_module = property(lambda self: self.model_state.stage_module)
    module = property(lambda self: self.built.module if self.built else None)
    stages = property(lambda self: self.built.stages if self.built else None)
    global_loss = property(lambda self: self.driver.global_loss)
    timeline = property(lambda self: self.driver.timeline)
    skipped_steps = property(lambda self: self.grad_sync.skipped_steps if self.grad_sync else 0)  # plain optimizers'

    def _compile_with(self, module, grad_sync, last: bool = False):
        # a pipeline's last stage under tp: its logits left split over the vocabulary, for the loss-parallel loss
        loss = self.driver.global_loss.vocab_parallel
        backend = functools.partial(gradsched_backend, grad_sync=grad_sync, plan=self.plan,
                                    tp_shards=self.model_state.tp_shards,
                                    vocab_outputs=loss.outputs if last and loss is not None else None)
        return torch.compile(module, fullgraph=self.fullgraph, backend=backend)

    def _shard_sequence(self, inputs, targets, positions=None, attention_mask=None):
        """Model inputs as a tuple, this rank's slice of the sequence under CP (gradsched.cp.layout.model_inputs)."""
        return model_inputs(self.plan, self.options.load_balance, inputs, targets, positions, attention_mask)

    def split(self, microbatch: tuple) -> build.Split:
        """Split the model into its pipeline stages, traced on one micro-batch (pipeline_build.split_model)."""
        return build.split_model(self.model, self.staging, microbatch, self.tie_override, self.within_module_ties)

    def compile_split(self, split: build.Split) -> None:
        """Compile this rank's stage(s) of a split (from `split`, here or in another ParallelModel of the model)."""
        self.built = build.compile_split(self.model_state, self.staging, split, self._compile_with)

    def allocate(self, inputs, targets, positions=None, attention_mask=None) -> None:
        """A model built on meta: allocate and initialize this rank's stage for batches like these (the first
        train_step does it otherwise), so that gradsched.load can fill it before any step."""
        driver.check_divides(inputs.shape[0], self.options.microbatches)
        inputs, targets = self._shard_sequence(inputs, targets, positions, attention_mask)
        if self.built is None:  # the pipeline is split for these shapes: every later step must have them
            self.driver.shape_check(inputs, targets)
            self._build_pipeline(tuple(t.chunk(self.options.microbatches)[0] for t in inputs))
        self.values.ready(self.stage_module, inputs[0].device)

    def _build_pipeline(self, microbatch: tuple):
        # on meta copies of the micro-batch for a meta model: only this rank's stage is allocated
        self.compile_split(self.split(tuple(t.to("meta") for t in microbatch) if self.values.on_meta else microbatch))
        self.schedule = build.start_pipeline(self.model_state, self.staging, self.built, self.values, microbatch[0].device,
                                             self.options.microbatches, self.global_loss, self.timeline)
        return self.built, self.schedule

    def train_step(self, inputs, targets, positions=None, attention_mask=None):
        """Forward and backward over this rank's batch (split into micro-batches), gradients reduced.
        positions / attention_mask ([batch, sequence], optional): handed to the model after its tokens (packed
        documents restart positions; attention_mask marks pads with 0). Returns the loss of the global batch, the
        same on every rank of the last stage; None on the other pipeline stages."""
        self.driver.steps += 1
        with driver.step_errors(self.driver.steps):
            self.values.check(inputs.device)
            driver.check_divides(inputs.shape[0], self.options.microbatches)
            inputs, targets = self._shard_sequence(inputs, targets, positions, attention_mask)
            return self.driver.run(inputs, targets, self.built, self.schedule, self._build_pipeline)

    # the parallel model's state: gradsched.training.model_state
    def named_parameters(self):
        return self.model_state.named_parameters()

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict:
        return self.model_state.state_dict()

    def unsplit_module(self) -> nn.Module:
        return self.model_state.unsplit_module()

    def schedule_report(self) -> str:
        return self.grad_sync.schedule_report()


def parallelize(model=None, *, plan: ParallelPlan, loss_fn, **kwargs):
    """Make a model (instance or class) train under `plan`; usable as a decorator."""
    if model is None:
        return functools.partial(parallelize, plan=plan, loss_fn=loss_fn, **kwargs)
    if isinstance(model, type):
        @functools.wraps(model, updated=())
        def build_instance(*args, **kw):
            return ParallelModel(model(*args, **kw), plan, loss_fn, **kwargs)
        return build_instance
    return ParallelModel(model, plan, loss_fn, **kwargs)
