"""gradsched: a torch.compile backend and FX passes that schedule gradient collectives.

Tied weights across pipeline stages are all-reduced before the bucketed
reduce-scatter of a distributed optimizer, and a static verifier proves it.
"""
from gradsched.backend import gradsched_backend
from gradsched.training.checkpoint import CheckpointError, load, save
from gradsched.training.clipping import clip_grad_norm_
from gradsched.launch import run_ranks
from gradsched.training.optimizer import DistributedOptimizer
from gradsched.options import SyncOptions
from gradsched.training.param_groups import weight_decay_groups
from gradsched.training.stage_balance import balanced_split_points
from gradsched.parallel import ParallelModel, parallelize
from gradsched.plan import ParallelPlan, PlanError
from gradsched.sync.nonfinite import NonFiniteError
from gradsched.sync.runtime import GradSync
from gradsched.sync.ties import Tie, shared_parameters
from gradsched.user_errors import StageError

__all__ = ["CheckpointError", "balanced_split_points", "DistributedOptimizer", "GradSync", "NonFiniteError", "ParallelModel", "ParallelPlan", "PlanError", "StageError", "SyncOptions", "Tie",
           "clip_grad_norm_", "gradsched_backend", "load", "parallelize", "run_ranks", "save", "shared_parameters",
           "weight_decay_groups"]
