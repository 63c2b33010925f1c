"""gradsched: a torch.compile backend and FX passes that schedule gradient collectives.

Tied weights across pipeline stages are all-reduced before the bucketed
reduce-scatter of a distributed optimizer, and a static verifier proves it.
"""
from .backend import gradsched_backend
from .checkpoint import CheckpointError, load, save
from .clipping import clip_grad_norm_
from .launch import run_ranks
from .optimizer import DistributedOptimizer
from .options import SyncOptions
from .param_groups import weight_decay_groups
from .parallel import ParallelModel, parallelize
from .plan import ParallelPlan, PlanError
from .runtime import GradSync
from .ties import Tie, shared_parameters
from .user_errors import StageError

__all__ = ["CheckpointError", "DistributedOptimizer", "GradSync", "ParallelModel", "ParallelPlan", "PlanError", "StageError", "SyncOptions", "Tie",
           "clip_grad_norm_", "gradsched_backend", "load", "parallelize", "run_ranks", "save", "shared_parameters",
           "weight_decay_groups"]
