"""A parallel model's state: what this rank trains, under which names, and the unsplit model's state dict.

The one interface through which the optimizer, clipping and checkpoints see a model that gradsched.parallelize
made: `state_of(model)` is its ModelState (None for a plain module or one compiled with backend="gradsched",
whose GradSync is found from its parameters instead).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsched.options import SyncOptions
from gradsched.plan import ParallelPlan
from gradsched.sync.owners import sync_of
from gradsched.sync.ties import shared_parameters
from gradsched.tp.local_shards import TensorParallelShards


class ModelState:
    """The unsplit model and, once built, this rank's stage module(s), its ties and its GradSync.

    Before the pipeline's split (pp > 1, at the first step) the rank trains the unsplit model's parameters; after
    it, its stage's, without the stale copies pipelining's split leaves (stage 0 keeps the head's tied weight under
    its own name, never used or updated there)."""

    def __init__(self, model: nn.Module, plan: ParallelPlan, options: SyncOptions, local: list[int]):
        self.model, self.plan, self.options, self.local = model, plan, options, local
        self.keys = list(model.state_dict().keys())  # the unsplit model's, tied names included
        self.within_module_ties = shared_parameters(model)
        self.ties = []
        self.stage_module: nn.Module | None = None  # this rank's stage(s), once built
        self.grad_sync = None  # its GradSync, once built
        # tp > 1: this rank's shards of the TP-sharded parameters, cut by the first graph that reads each
        self.tp_shards = (TensorParallelShards(plan.tp, plan.index("tp"), plan.process_group("tp"))
                          if plan.tp > 1 else None)

    @property
    def built(self) -> bool:
        return self.stage_module is not None

    def unsplit_module(self) -> nn.Module:
        """The model as the user built it (what checkpoints and parameter groups name)."""
        return self.model

    def trained_module(self) -> nn.Module:
        """The module whose tensors this rank trains: its stage under pp > 1 (once built), else the model."""
        return self.stage_module if self.built else self.model

    def stale_names(self) -> set:
        """Names this rank's stage holds and never trains: tied copies whose tie lives on another stage
        (pipelining's split keeps them). Empty before the split."""
        if not self.built:
            return set()
        mine = {n for t in self.ties for s, n in t.members if s in self.local}
        return {n for t in self.ties for s, n in t.members if s not in self.local} - mine

    def named_parameters(self):
        """This rank's parameters, each once, with the values it trains (under tp > 1 its TP shards, once cut);
        under shard=True the last step's parameter all-gather lands first (a wait, no new collective)."""
        if self.grad_sync is not None:
            self.grad_sync.finish_param_gather()
        stale = self.stale_names()
        return ((n, self.trained(p)) for n, p in self.trained_module().named_parameters() if n not in stale)

    def trained(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """The Parameter this rank trains for the model's `p`: its TP shard where it has one, else `p`."""
        shard = self.tp_shards.of(p) if self.tp_shards is not None else None
        return p if shard is None else shard

    def state_dict(self) -> dict:
        """The full, unsplit model's state dict, tied names included, with the trained values: the keys and order
        of `model.state_dict()` in one process. Under pp > 1 every rank must call it (it gathers the stages over
        the pipeline group)."""
        local = self.local_state()
        if not self.built or self.plan.pp == 1:
            return {k: local[k].detach() for k in self.keys}
        stale = self.stale_names()
        local = {k: v.detach().cpu() for k, v in local.items() if k not in stale}
        stages = [None] * self.plan.pp
        dist.all_gather_object(stages, local, group=self.plan.process_group("pp"))
        full = {k: v for stage in stages for k, v in stage.items()}
        missing = [k for k in self.keys if k not in full]
        if missing:
            raise RuntimeError(f"gradsched: no stage holds {missing} of the model's state dict.")
        return {k: full[k] for k in self.keys}

    def local_state(self) -> dict:
        """This rank's module's state dict, whole: under shard="params" its parameters gathered over dp x cp (their
        own storage is released: read, they would read memory they no longer own), under tp > 1 its TP shards
        gathered over TP (every TP rank calls it)."""
        sync = self.grad_sync
        if sync is not None:  # shard=True: the last step's parameter all-gather lands first
            sync.finish_param_gather()
        module = self.trained_module()
        local = module.state_dict()
        params_sharded = sync is not None and sync.param_shards is not None
        if not params_sharded and self.tp_shards is None:
            return local
        full = sync.full_parameters() if params_sharded else {}
        by_id = {id(p): full[n] for n, p in sync.params.items()} if params_sharded else {}
        names = dict(module.named_parameters(remove_duplicate=False))
        gathered = {}  # id(whole Parameter) -> its value gathered over TP (a tied one is gathered once)
        out = {}
        for k, v in local.items():
            p = names.get(k)
            trained = self.trained(p) if p is not None else None
            if trained is None or trained is p:
                out[k] = by_id.get(id(p), v)
                continue
            if id(p) not in gathered:
                gathered[id(p)] = self.tp_shards.gather(p, by_id.get(id(trained), trained).detach())
            out[k] = gathered[id(p)]
        return out


def state_of(model) -> ModelState | None:
    """A gradsched.parallelize model's ModelState; None for anything else."""
    state = getattr(model, "model_state", None)
    return state if isinstance(state, ModelState) else None


def find_sync(model):
    """The GradSync of a gradsched.parallelize model (None before its first step), or of a model compiled with
    backend="gradsched", found from its parameters."""
    state = state_of(model)
    return state.grad_sync if state is not None else sync_of(model.parameters())


def unsplit_module(model) -> torch.nn.Module:
    """The model as the user built it: a parallel model's unsplit model, a torch.compile'd model's original
    module, or the module itself."""
    state = state_of(model)
    return state.unsplit_module() if state is not None else getattr(model, "_orig_mod", model)


def trained_module(model) -> torch.nn.Module:
    """The module whose tensors this rank trains: a parallel model's stage (once built), else the model."""
    state = state_of(model)
    return state.trained_module() if state is not None else unsplit_module(model)


def stale_names(model) -> set:
    state = state_of(model)
    return state.stale_names() if state is not None else set()


def options_of(model) -> SyncOptions | None:
    """A parallel model's options (the optimizer checks them before the first step); None otherwise."""
    state = state_of(model)
    return state.options if state is not None else None
