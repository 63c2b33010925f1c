"""parallelize: a model, a plan and options in; a trainable parallel model out.

    @gradsched.parallelize(plan=plan, loss_fn=lm_loss, microbatches=4)
    class MyGPT(nn.Module): ...

    model = gradsched.parallelize(MyGPT(), plan=plan, loss_fn=lm_loss)   # or on an instance
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = model.train_step(inputs, targets); opt.step()

pp > 1 splits the model with torch.distributed.pipelining (`split_points`:
module names that begin a new stage) and runs its GPipe, 1F1B or zero-bubble
(ZB-H1: "zb1p") schedule; each stage is compiled with the gradsched backend and
its tied copies are found from the split (or from `ties=` as an override).
"""
from __future__ import annotations

import contextlib
import functools
import types
import warnings

import torch
import torch.nn as nn

from gradsched.backend import gradsched_backend
from gradsched.cp.layout import check_takes_seq_idx, model_inputs
from gradsched.options import SyncOptions
from gradsched.training.pipeline_split import (check_adjacent_stages, check_first_stage_inputs, check_stage_count,
                                               checkpoint_stage_modules, checkpointed_calls, hf_checkpointed_layers,
                                               pass_through_skips, release_other_stages, warn_checkpointing_dropped)
from gradsched.plan import ParallelPlan
from gradsched.sync.replicas import make_replicas_equal
from gradsched.sync.boundaries import agree_stage_boundaries
from gradsched.sync.runtime import GradSync
from gradsched.sync.stage_setup import setup_stage
from gradsched.sync.watchdog import JOURNAL, configure as configure_watchdog, is_comm_error
from gradsched.sync.ties import check_one_copy_per_stage, shared_parameters, ties_from_override, ties_from_pipe
from gradsched.training import loss_weights
from gradsched.training.global_loss import GlobalLoss
from gradsched.training.pipeline_schedule import (SPLIT_BACKWARD, Timeline, pipeline_schedule, resolve_schedule,
                                                  stage_placement)
from gradsched.training.virtual_stages import (RankStages, local_stages, merge_local_ties, refuse_with_several_stages,
                                               stage_ranks)
from gradsched.training.materialize import check_init, deferred_init, materialize
from gradsched.user_errors import StageError, check_split_points, in_stage, in_user_code, own_error, root_cause



class ParallelModel:
    def __init__(self, model: nn.Module, plan: ParallelPlan, loss_fn, split_points=(), schedule="auto",
                 ties=None, fullgraph=True, ignore_index=-100, init_weights=None, init_seed=0, stages_per_rank=None,
                 **options):
        self.model, self.plan, self.loss_fn = model, plan, loss_fn
        self.options = SyncOptions.from_dict(options)
        schedule = resolve_schedule(schedule, plan.pp, self.options.microbatches)
        self.stages_per_rank, self.placement_style = stage_placement(schedule, stages_per_rank)
        self.num_stages = plan.pp * self.stages_per_rank
        if plan.pp > 1 and len(split_points) != self.num_stages - 1:
            raise ValueError(f"pp={plan.pp}{f' x stages_per_rank={self.stages_per_rank}' * (self.stages_per_rank > 1)}"
                             f" needs {self.num_stages - 1} split_points (module names that begin a stage, e.g. "
                             f"['blocks.1']), got {list(split_points)}.")
        check_split_points(model, split_points)
        if self.options.load_balance == "documents" and plan.cp > 1:
            check_takes_seq_idx(model)
        self.split_points, self.schedule_name, self.tie_override = list(split_points), schedule, ties
        if self.options.shard == "params" and not fullgraph:
            raise ValueError("shard='params' needs fullgraph=True: code between graph breaks runs eagerly and would "
                             "read parameters whose storage lives only in the shards. Remove the graph breaks (or "
                             "use shard=True).")
        self.fullgraph, self.ignore_index = fullgraph, ignore_index
        self._init = deferred_init(model, init_weights, init_seed)  # a model on meta: allocated per stage at step 1
        if self.stages_per_rank > 1:
            refuse_with_several_stages(self.options, plan)
        self._local = None
        self.within_module_ties = shared_parameters(model)
        self._keys = list(model.state_dict().keys())  # the unsplit model's, tied names included
        self.grad_sync = None
        self.module = None
        self._steps = 0
        configure_watchdog(plan.describe() if torch.distributed.is_initialized() and plan.world > 1 else "",
                           self.options.fault_timeout_s, self.options.compile_timeout_s)
        self._shapes = None  # under pp > 1: the micro-batch shapes the stages were built for
        self.global_loss = GlobalLoss(loss_fn, plan, self.options.average, ignore_index,
                                      self.options.compiler if plan.pp > 1 else "eager")
        self.timeline = Timeline()  # the schedule's work per micro-batch, when timeline.on (benchmarks/pipeline.py)
        self._replicas_equal = False
        if plan.pp == 1:
            self._build(ties=[], stage_module=model)
            self._make_replicas_equal()

    @property
    def local(self) -> list[int]:
        """The pipeline stages this rank holds (one, or several under stages_per_rank)."""
        if self._local is None:
            self._local = local_stages(self.plan.stage, self.plan.pp, self.stages_per_rank, self.placement_style)
        return self._local

    def _build(self, ties, stage_module):
        self.ties = ties
        setup = setup_stage(self.plan, self.options, ties, aliases=self.within_module_ties)
        # train_step marks each step's last micro-batch
        self.grad_sync = GradSync(setup, self.options, explicit_steps=True,
                                  split_backward=self.schedule_name in SPLIT_BACKWARD)
        self.stage_module = stage_module
        backend = functools.partial(gradsched_backend, grad_sync=self.grad_sync, plan=self.plan)
        self.module = torch.compile(stage_module, fullgraph=self.fullgraph, backend=backend)
        # pp = 1: the loss and its weight in the stage's graph (DDP's loss runs eagerly, op by op)
        self.loss_step = torch.compile(types.MethodType(_stage_loss, stage_module), fullgraph=self.fullgraph,
                                       backend=backend)
        self._loss_in_graph = None  # decided by the first micro-batch (_microbatch_loss)

    def _shard_sequence(self, inputs, targets, positions=None, attention_mask=None):
        """Model inputs as a tuple, this rank's slice of the sequence under CP (gradsched.cp.layout.model_inputs)."""
        return model_inputs(self.plan, self.options.load_balance, inputs, targets, positions, attention_mask)

    def split(self, microbatch: tuple):
        """Split the model into pp stages at `split_points` (torch.distributed.pipelining, traced on one
        micro-batch). Returns (pipe, ties, checkpointed calls); every rank checks every stage, so all
        refuse a bad split before any step."""
        from torch.distributed.pipelining import SplitPoint, pipeline
        # Trace under no_grad: a module whose forward is itself decorated with no_grad (HF's
        # rotary embedding) otherwise becomes a wrap_with_set_grad_enabled op that export's
        # unflattener turns into a call with no arguments. The stages still run under
        # autograd; only the trace is affected.
        try:
            with torch.no_grad(), checkpointed_calls() as checkpointed, warnings.catch_warnings():
                # torch's own deepcopy of the traced graph's pytree specs warns of its own deprecated LeafSpec
                warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
                pipe = pipeline(self.model, mb_args=microbatch,
                                split_spec={name: SplitPoint.BEGINNING for name in self.split_points})
        except Exception as e:  # export's message is generic; the model's own error is in the chain
            what = f"splitting {type(self.model).__name__} into {self.num_stages} pipeline stages at {self.split_points}"
            err = in_user_code(f"{what} failed in the model's code", e)
            if err is None:  # the tracer's own limits: say what is known to cause them
                cause = root_cause(e)
                err = StageError(
                    f"{what} failed in torch.distributed.pipelining: {type(cause).__name__}: {cause}. Known causes: "
                    "a submodule object shared by blocks on both sides of a split point (share its Parameters "
                    "instead), or a weight shared with a module the split moves to another stage; try other "
                    "split points.")
            raise err from e
        check_stage_count(pipe, self.split_points, type(self.model).__name__)
        check_first_stage_inputs(pipe, type(self.model).__name__)
        pass_through_skips(pipe)  # e.g. a decoder's rotary embeddings, read by every stage from the first
        check_adjacent_stages(pipe, type(self.model).__name__)
        ties = ties_from_override(self.tie_override) if self.tie_override is not None else ties_from_pipe(pipe)
        for stage in range(self.num_stages):
            check_one_copy_per_stage(pipe.get_stage_module(stage), stage, self.within_module_ties)
        return pipe, ties, checkpointed

    def build_stage(self, pipe, ties, checkpointed) -> None:
        """Compile this rank's stage of a split (from `split`, here or in another ParallelModel of the same
        model: the dry run splits once for every role)."""
        if self.stages_per_rank > 1:
            return self._build_several(pipe, ties, checkpointed)
        stage_module = pipe.get_stage_module(self.plan.stage)
        lost = checkpoint_stage_modules(stage_module, self.model, checkpointed + hf_checkpointed_layers(self.model))
        if lost:
            warn_checkpointing_dropped(len(lost), self.plan.pp)
        self._build(ties, stage_module)

    def _build_several(self, pipe, ties, checkpointed) -> None:
        """Several stages a rank: each compiled on its own, one GradSync over them all; a tie whose copies sit on
        this rank made one Parameter (gradsched.training.virtual_stages)."""
        modules = {s: pipe.get_stage_module(s) for s in self.local}
        calls = checkpointed + hf_checkpointed_layers(self.model)
        lost = sum(len(checkpoint_stage_modules(m, self.model, calls)) for m in modules.values())
        if lost:
            warn_checkpointing_dropped(lost, self.plan.pp)
        ranks = stage_ranks(self.plan.pp, self.stages_per_rank, self.placement_style)
        across, merged = merge_local_ties(modules, ties, ranks)
        self.ties = ties
        setup = setup_stage(self.plan, self.options, across, aliases=self.within_module_ties)
        self.grad_sync = GradSync(setup, self.options, explicit_steps=True,
                                  split_backward=self.schedule_name in SPLIT_BACKWARD,
                                  canonical={n: names[0] for names in merged for n in names})
        backend = functools.partial(gradsched_backend, grad_sync=self.grad_sync, plan=self.plan)
        self.stage_module = RankStages([modules[s] for s in self.local])
        self.stages = [(s, torch.compile(modules[s], fullgraph=self.fullgraph, backend=backend), modules[s])
                       for s in self.local]
        self.module = self.stages[0][1]

    def allocate(self, inputs, targets, positions=None, attention_mask=None) -> None:
        """A model built on meta: allocate and initialize this rank's stage for batches like these (the first
        train_step does it otherwise), so that gradsched.load can fill it before any step."""
        if inputs.shape[0] % self.options.microbatches:
            raise ValueError(f"batch of {inputs.shape[0]} does not split into microbatches={self.options.microbatches}.")
        inputs, targets = self._shard_sequence(inputs, targets, positions, attention_mask)
        if self.module is None:  # the pipeline is split for these shapes: every later step must have them
            self._check_same_shapes(inputs, targets)
            self._build_pipeline(tuple(t.chunk(self.options.microbatches)[0] for t in inputs))
        self._init = materialize(self.stage_module, inputs[0].device, self._init)
        self._make_replicas_equal()

    def _make_replicas_equal(self) -> None:
        """Once, when this rank's stage is final and holds values (split, allocated), before any graph of it runs
        or shards it: every replica of the stage checked alike and given its first replica's values."""
        if not self._replicas_equal and self._init is None and self.module is not None:
            self._replicas_equal = True
            make_replicas_equal(self.stage_module, self.plan)

    def _build_pipeline(self, microbatch: tuple):
        meta = self._init is not None  # split on meta copies of the micro-batch: only this rank's stage is allocated
        self.build_stage(*self.split(tuple(t.to("meta") for t in microbatch) if meta else microbatch))
        stages = self.stages if self.stages_per_rank > 1 else [(self.plan.stage, self.module, self.stage_module)]
        # before anything is sent: a mismatch named at its source
        agree_stage_boundaries({s: m for s, _, m in stages}, self.plan, self.num_stages)
        self._init = materialize(self.stage_module, microbatch[0].device, self._init)
        release_other_stages(self.model, self.stage_module)  # the other stages' weights: not this rank's to keep
        self._make_replicas_equal()
        device = next(self.module.parameters()).device  # the stage runs where its weights are
        self.schedule = pipeline_schedule(self.schedule_name, stages, self.num_stages, self.plan, self.grad_sync,
                                          self.options.microbatches, device, self.global_loss, self.timeline)

    def train_step(self, inputs, targets, positions=None, attention_mask=None):
        """Forward and backward over this rank's batch (split into micro-batches), gradients reduced.

        positions / attention_mask ([batch, sequence], optional): handed to the model after its
        tokens (packed documents restart positions; attention_mask marks pads with 0).

        Returns the loss of the global batch (gradsched.training.global_loss), the same on every rank of the
        last stage; None on the other pipeline stages.
        """
        self._steps += 1
        try:
            # the first step traces and compiles (Dynamo's trace before the backend included): peers
            # waiting for it meanwhile give it compile_timeout_s (gradsched.sync.stuck)
            with JOURNAL.entry(f"train_step {self._steps}: the stage's schedule (forward, backward, CP and p2p "
                               "collectives in its compiled graphs)", "compile" if self._steps == 1 else "phase"):
                return self._train_step(inputs, targets, positions, attention_mask)
        except Exception as e:  # gradsched's own error, not the wrapper Dynamo or pipelining put around it
            own = own_error(e)
            if own is None or own is e:
                raise
            raise own from None

    def _train_step(self, inputs, targets, positions=None, attention_mask=None):
        check_init(self._init, inputs.device)
        m = self.options.microbatches
        if inputs.shape[0] % m:
            raise ValueError(f"batch of {inputs.shape[0]} does not split into microbatches={m}.")
        inputs, targets = self._shard_sequence(inputs, targets, positions, attention_mask)
        if self.plan.pp > 1:
            self._check_same_shapes(inputs, targets)
        last_stage = self.num_stages - 1 in self.local
        if last_stage:
            self.global_loss.begin(targets, m)
        if self.plan.pp == 1:
            self._init = materialize(self.stage_module, inputs[0].device, self._init)
            self._make_replicas_equal()
            losses = []
            with self._stage_errors():
                for i, (x, y) in enumerate(zip(zip(*(t.chunk(m) for t in inputs)), targets.chunk(m))):
                    loss = self._microbatch_loss(x, y, i)
                    losses.append(loss.detach())
                    if i < m - 1:  # autograd accumulates (GradSync's step boundary is off between steps)
                        loss.backward()
                        continue
                    issued = self.global_loss.issue(self.grad_sync, losses)  # hidden by the backward (shard=False)
                    with self.grad_sync.step_boundary(last=True):
                        loss.backward()
        else:
            if self.module is None:
                self._build_pipeline(tuple(t.chunk(m)[0] for t in inputs))
            first, losses, issued = 0 in self.local, [], None
            self.grad_sync.begin_step()
            with self._stage_errors():
                # return_outputs=False: the last stage would keep every micro-batch's logits to the next step
                self.schedule.step(*(inputs if first else ()), return_outputs=False,
                                   **({"target": targets, "losses": losses} if last_stage else {}))
        with self.timeline.span("sync"):
            self.grad_sync.flush()
        return self.global_loss.end(self.grad_sync, losses if last_stage else None, issued)

    def _microbatch_loss(self, x, y, i: int):
        """pp = 1: micro-batch i's weighted loss, computed in the stage's compiled graph (its forward and backward
        then run no eager op of the loss's); a loss_fn Dynamo cannot trace whole (fullgraph) runs eagerly after
        the stage's graph instead, with a warning."""
        if self._loss_in_graph is not False:
            try:
                loss = self.loss_step(self.loss_fn, x, y, *self.global_loss.gate(i, y.device))
                self._loss_in_graph = True
                return loss
            except torch._dynamo.exc.Unsupported as e:
                if self._loss_in_graph:
                    raise
                self._loss_in_graph = False  # nothing ran: Dynamo refuses before any graph is compiled
                why = str(e).splitlines()[0]
                warnings.warn(f"gradsched: loss_fn could not be compiled into the stage's graph ({why}"
                              "); it runs eagerly after the stage's graph, op by op (more host time per micro-batch). "
                              "Make it traceable by torch.compile(fullgraph=True) to remove that.", stacklevel=4)
        return self.global_loss(self.module(*x), y, i)

    @contextlib.contextmanager
    def _stage_errors(self):
        """An error of the model's code while its stage runs names the model's line, not the
        generated code of the stage's graph or the wrappers of Dynamo and pipelining."""
        try:
            yield
        except Exception as e:
            if own_error(e) is not None:
                raise
            stage = f"pipeline stage {self.plan.stage} of {self.plan.pp}" if self.plan.pp > 1 else "the training step"
            if is_comm_error(e):
                raise  # another rank stopped: the journal's entry names which (gradsched.sync.watchdog)
            raise in_stage(f"{stage} failed in the model's code", e, self.stage_module, self.options.compiler) from e

    def _check_same_shapes(self, inputs, targets):
        """pipelining fixes every stage's shapes at the split and its first step: refuse other
        shapes on this rank before anything is sent (a stage would fail mid-schedule)."""
        m = self.options.microbatches
        shapes = ([tuple(t.chunk(m)[0].shape) for t in inputs], tuple(targets.chunk(m)[0].shape))
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(
                f"pp={self.plan.pp}: the pipeline stages were split and shaped for micro-batches of inputs "
                f"{self._shapes[0]} and targets {self._shapes[1]} (the first step's), but this step's are "
                f"{shapes[0]} and {shapes[1]}. Under pp > 1 keep the batch size, microbatches and sequence "
                "length the same every step (pad sequences to one length), or train with pp=1.")

    def named_parameters(self):
        """This rank's parameters, each once, with the values it trains. Under pp > 1 that is its stage's,
        without the stale copies pipelining's split leaves (stage 0 keeps the head's tied weight under
        its own name, never used or updated there)."""
        if self.module is None:
            return self.model.named_parameters()
        stale = self.stale_names()
        return ((n, p) for n, p in self.stage_module.named_parameters() if n not in stale)

    def unsplit_module(self) -> nn.Module:
        """The model as the user built it (what checkpoints and parameter groups name)."""
        return self.model

    def trained_module(self) -> nn.Module:
        """The module whose tensors this rank trains: its stage under pp > 1 (once built), else the model."""
        return self.stage_module if self.module is not None else self.model

    def stale_names(self) -> set:
        """Names this rank's stage holds and never trains: tied copies whose tie lives on another stage
        (pipelining's split keeps them). Empty before the split."""
        if self.module is None:
            return set()
        mine = {n for t in self.ties for s, n in t.members if s in self.local}
        return {n for t in self.ties for s, n in t.members if s not in self.local} - mine

    def state_dict(self) -> dict:
        """The full, unsplit model's state dict, tied names included, with the trained values: the
        keys and order of `model.state_dict()` in one process. Under pp > 1 every rank must call it
        (it gathers the stages over the pipeline group)."""
        import torch.distributed as dist
        keys = self._keys
        local = self._local_state()
        if self.module is None or self.plan.pp == 1:
            return {k: local[k].detach() for k in keys}
        stale = self.stale_names()
        local = {k: v.detach().cpu() for k, v in local.items() if k not in stale}
        stages = [None] * self.plan.pp
        dist.all_gather_object(stages, local, group=self.plan.process_group("pp"))
        full = {k: v for stage in stages for k, v in stage.items()}
        missing = [k for k in keys if k not in full]
        if missing:
            raise RuntimeError(f"gradsched: no stage holds {missing} of the model's state dict.")
        return {k: full[k] for k in keys}

    def parameters(self):
        return (p for _, p in self.named_parameters())

    def _local_state(self) -> dict:
        """This rank's module's state dict; under shard="params", with the parameters gathered whole (their own
        storage is released: read, they would read memory they no longer own)."""
        local = (self.stage_module if self.module is not None else self.model).state_dict()
        if self.grad_sync is None or self.grad_sync.param_shards is None:
            return local
        full = self.grad_sync.full_parameters()
        by_id = {id(p): full[n] for n, p in self.grad_sync.params.items()}
        names = dict(self.stage_module.named_parameters(remove_duplicate=False))
        return {k: by_id.get(id(names.get(k)), v) for k, v in local.items()}

    def schedule_report(self) -> str:
        return self.grad_sync.schedule_report()


def _stage_loss(stage_module, loss_fn, args, target, keep, weight):
    """The stage's forward and its weighted loss, compiled as a method of the stage module: Dynamo sees the module
    as `self`, as under torch.compile(module) (its parameters named as the module names them)."""
    return loss_weights.gated(loss_fn, stage_module(*args), target, keep, weight, in_graph=True)


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
