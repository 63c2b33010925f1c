"""A parallel model's construction: its options checked, the model split into pipeline stages, this rank's
stage(s) compiled over one GradSync, the schedule that runs them.

The compiler is handed in (`compile_with(module, grad_sync)`: torch.compile with the gradsched backend), so that
this room never imports the public API above it.
"""
from __future__ import annotations

import fnmatch
import types
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn

from gradsched.cp.layout import check_takes_seq_idx
from gradsched.options import SyncOptions
from gradsched.plan import ParallelPlan
from gradsched.sync.boundaries import agree_stage_boundaries
from gradsched.sync.runtime import GradSync
from gradsched.sync.stage_setup import setup_stage
from gradsched.sync.ties import check_one_copy_per_stage, ties_from_override, ties_from_pipe
from gradsched.training import loss_weights
from gradsched.training.model_state import ModelState
from gradsched.training.pipeline_schedule import CUT_BACKWARD, pipeline_schedule
from gradsched.training.pipeline_split import (check_adjacent_stages, check_first_stage_inputs, check_stage_count,
                                               checkpoint_stage_modules, checkpointed_calls, hf_checkpointed_layers,
                                               pass_through_skips, release_other_stages, release_stale_copies,
                                               release_unread_tied_copies, train_the_users_tied_parameters,
                                               warn_checkpointing_dropped)
from gradsched.training.stage_values import StageValues
from gradsched.training.virtual_stages import RankStages, merge_local_ties, refuse_with_several_stages, stage_ranks
from gradsched.user_errors import StageError, check_split_points, in_user_code, root_cause


@dataclass(frozen=True)
class Staging:
    """How the model is cut: the schedule, the stages a rank holds and where they begin."""
    schedule: str
    stages_per_rank: int
    assignment_style: str  # virtual_stages' assignment of a rank's stages ("loop" or "v")
    split_points: tuple[str, ...]
    num_stages: int  # pp x stages_per_rank


def check_options(model: nn.Module, plan: ParallelPlan, options: SyncOptions, staging: Staging, fullgraph: bool) -> None:
    """Refusals that need no trace: before anything is split, compiled or sent."""
    if plan.pp > 1 and len(staging.split_points) != staging.num_stages - 1:
        v = staging.stages_per_rank
        raise ValueError(f"pp={plan.pp}{f' x stages_per_rank={v}' * (v > 1)} needs {staging.num_stages - 1} split_points "
                         f"(module names that begin a stage, e.g. ['blocks.1']), got {list(staging.split_points)}.")
    check_split_points(model, staging.split_points)
    if options.load_balance == "documents" and plan.cp > 1:
        check_takes_seq_idx(model)
    if options.shard == "params" and not fullgraph:
        raise ValueError("shard='params' needs fullgraph=True: code between graph breaks runs eagerly and would "
                         "read parameters whose storage lives only in the shards. Remove the graph breaks (or "
                         "use shard=True).")
    if staging.stages_per_rank > 1:
        refuse_with_several_stages(options, plan)
    if options.tp_plan:
        check_tp_plan(model, plan, options.tp_plan)


def check_tp_plan(model: nn.Module, plan: ParallelPlan, tp_plan: dict) -> None:
    """tp_plan's patterns each name a module of the model that holds parameters, at tp > 1 (a typo would
    otherwise leave the found roles in place without a word)."""
    if plan.tp == 1:
        raise ValueError(f"gradsched option tp_plan={tp_plan!r} overrides tensor parallelism's roles, but the plan "
                         "has tp=1: leave it out, or use ParallelPlan.from_world(tp=...).")
    modules = [n for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    for pattern in tp_plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in modules):
            raise ValueError(f"gradsched option tp_plan: {pattern!r} names no module of {type(model).__name__} that "
                             f"holds parameters (they are named like {modules[:3]}); patterns are fnmatch's, "
                             "e.g. 'model.layers.*.mlp.down_proj'.")


class Split(NamedTuple):
    pipe: object  # torch.distributed.pipelining's Pipe
    ties: list  # gradsched.sync.ties.Tie, across its stages
    checkpointed: list  # the activation-checkpointed calls the trace saw


def split_model(model: nn.Module, staging: Staging, microbatch: tuple, tie_override, within_module_ties) -> Split:
    """Split the model into stages at the staging's split points (torch.distributed.pipelining, traced on one
    micro-batch). Every rank checks every stage, so all refuse a bad split before any step."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    # Trace under no_grad: a module whose forward is itself decorated with no_grad (HF's rotary embedding)
    # otherwise becomes a wrap_with_set_grad_enabled op that export's unflattener turns into a call with no
    # arguments. The stages still run under autograd; only the trace is affected.
    try:
        with torch.no_grad(), checkpointed_calls() as checkpointed, warnings.catch_warnings():
            # torch's own deepcopy of the traced graph's pytree specs warns of its own deprecated LeafSpec
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            pipe = pipeline(model, mb_args=microbatch,
                            split_spec={name: SplitPoint.BEGINNING for name in staging.split_points})
    except Exception as e:  # export's message is generic; the model's own error is in the chain
        what = (f"splitting {type(model).__name__} into {staging.num_stages} pipeline stages at "
                f"{list(staging.split_points)}")
        err = in_user_code(f"{what} failed in the model's code", e)
        if err is None:  # the tracer's own limits: say what is known to cause them
            cause = root_cause(e)
            err = StageError(
                f"{what} failed in torch.distributed.pipelining: {type(cause).__name__}: {cause}. Known causes: "
                "a submodule object shared by blocks on both sides of a split point (share its Parameters "
                "instead), or a weight shared with a module the split moves to another stage; try other "
                "split points.")
        raise err from e
    name = type(model).__name__
    check_stage_count(pipe, list(staging.split_points), name)
    check_first_stage_inputs(pipe, name)
    pass_through_skips(pipe)  # e.g. a decoder's rotary embeddings, read by every stage from the first
    check_adjacent_stages(pipe, name)
    ties = ties_from_override(tie_override) if tie_override is not None else ties_from_pipe(pipe)
    for stage in range(staging.num_stages):
        check_one_copy_per_stage(pipe.get_stage_module(stage), stage, within_module_ties)
    return Split(pipe, ties, checkpointed)


@dataclass
class Built:
    """This rank's compiled stage(s): (stage index, compiled module, stage module) each, and the pp = 1 loss."""
    stages: list
    loss_step: object = None  # pp = 1: the stage's forward and weighted loss in one compiled graph

    @property
    def module(self):
        return self.stages[0][1]


def compile_unsplit(state: ModelState, staging: Staging, compile_with) -> Built:
    """pp = 1: the whole model is the rank's one stage, its loss compiled into the stage's graph."""
    state.ties, state.stage_module = [], state.model
    state.grad_sync = _grad_sync(state, staging, [])
    loss_step = compile_with(types.MethodType(_stage_loss, state.model), state.grad_sync)
    return Built([(0, compile_with(state.model, state.grad_sync), state.model)], loss_step)


def compile_split(state: ModelState, staging: Staging, split: Split, compile_with) -> Built:
    """This rank's stage(s) of a split (from split_model, here or in another model of the same split: the dry
    run splits once for every role), each compiled on its own, one GradSync over them all; a tie whose copies
    sit on this rank made one Parameter (gradsched.training.virtual_stages)."""
    modules = {s: split.pipe.get_stage_module(s) for s in state.local}
    calls = split.checkpointed + hf_checkpointed_layers(state.model)
    lost = sum(len(checkpoint_stage_modules(m, state.model, calls)) for m in modules.values())
    if lost:
        warn_checkpointing_dropped(lost, state.plan.pp)
    state.ties = split.ties
    train_the_users_tied_parameters(state.model, modules, split.ties)  # what model.parameters() hands an optimizer
    if staging.stages_per_rank == 1:
        state.stage_module = modules[state.local[0]]
        state.grad_sync = _grad_sync(state, staging, split.ties)
    else:
        ranks = stage_ranks(state.plan.pp, staging.stages_per_rank, staging.assignment_style)
        across, merged = merge_local_ties(modules, split.ties, ranks)
        state.stage_module = RankStages([modules[s] for s in state.local])
        state.grad_sync = _grad_sync(state, staging, across, canonical={n: names[0] for names in merged for n in names})
    last = staging.num_stages - 1
    return Built([(s, compile_with(modules[s], state.grad_sync, last=s == last), modules[s]) for s in state.local])


def start_pipeline(state: ModelState, staging: Staging, built: Built, values: StageValues, device, m: int,
                   global_loss, timeline):
    """After the split's stages are compiled, before anything is sent: the stage boundaries agreed (a mismatch
    named at its source), the stage allocated, the other stages' weights released, its replicas made equal;
    returns the schedule that runs it."""
    agree_stage_boundaries({s: mod for s, _, mod in built.stages}, state.plan, staging.num_stages)
    values.allocate(state.stage_module, device)
    release_other_stages(state.model, state.stage_module)  # the other stages' weights: not this rank's to keep
    values.make_replicas_equal(state.stage_module)
    release_stale_copies(state.stage_module, state.stale_names())  # after the broadcast, which sends them
    release_unread_tied_copies(getattr(state.stage_module, "stage_modules", ()),
                               {n for t in state.ties for _, n in t.members})
    device = next(built.module.parameters()).device  # the stage runs where its weights are
    return pipeline_schedule(staging.schedule, built.stages, staging.num_stages, state.plan, state.grad_sync, m, device,
                             global_loss, timeline)


def _grad_sync(state: ModelState, staging: Staging, ties, **kw) -> GradSync:
    setup = setup_stage(state.plan, state.options, ties, aliases=state.within_module_ties)
    # the step driver marks each step's last micro-batch
    return GradSync(setup, state.options, explicit_steps=True, cut_backward=staging.schedule in CUT_BACKWARD, **kw)


def _stage_loss(stage_module, loss_fn, args, target, keep, weight):
    """The stage's forward and its weighted loss, compiled as a method of the stage module: Dynamo sees the module
    as `self`, as under torch.compile(module) (its parameters named as the module names them)."""
    return loss_weights.gated(loss_fn, stage_module(*args), target, keep, weight, in_graph=True)
