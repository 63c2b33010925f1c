"""gradsched: a torch.compile backend and FX passes that schedule gradient collectives.

Tied weights across pipeline stages are all-reduced before the bucketed
reduce-scatter of a distributed optimizer, and a static verifier proves it.
"""
from .backend import gradsched_backend
from .launch import run_ranks
from .optimizer import DistributedOptimizer
from .options import SyncOptions
from .parallel import ParallelModel, parallelize
from .plan import ParallelPlan, PlanError
from .runtime import GradSync
from .ties import Tie, shared_parameters
from .user_errors import StageError

__all__ = ["DistributedOptimizer", "GradSync", "ParallelModel", "ParallelPlan", "PlanError", "StageError", "SyncOptions", "Tie",
           "gradsched_backend", "parallelize", "run_ranks", "shared_parameters"]
