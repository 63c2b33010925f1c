"""A stage's values before its first graph runs: allocated and initialized where the model was built on meta
(gradsched.training.materialize), then every replica of the stage given its first replica's values, once
(gradsched.sync.replicas)."""
from __future__ import annotations

import torch
import torch.nn as nn

from gradsched.plan import ParallelPlan
from gradsched.sync.replicas import make_replicas_equal
from gradsched.training.materialize import check_init, deferred_init, materialize


class StageValues:
    def __init__(self, model: nn.Module, plan: ParallelPlan, init_weights, init_seed: int):
        self.plan = plan
        self.pending = deferred_init(model, init_weights, init_seed)  # a model on meta: allocated per stage
        self.equal = False

    @property
    def on_meta(self) -> bool:
        """Still shapes without values (the stage not yet allocated, or the dry run's meta inputs)."""
        return self.pending is not None

    def check(self, device: torch.device) -> None:
        check_init(self.pending, device)

    def allocate(self, stage_module: nn.Module, device: torch.device) -> None:
        self.pending = materialize(stage_module, device, self.pending)

    def make_replicas_equal(self, stage_module: nn.Module) -> None:
        """Once, when this rank's stage is final and holds values (split, allocated), before any graph of it runs
        or shards it: every replica of the stage checked alike and given its first replica's values."""
        if not self.equal and self.pending is None:
            self.equal = True
            make_replicas_equal(stage_module, self.plan)

    def ready(self, stage_module: nn.Module, device: torch.device) -> None:
        """Allocated (where built on meta), then its replicas made equal."""
        self.allocate(stage_module, device)
        self.make_replicas_equal(stage_module)
