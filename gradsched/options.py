"""Options of the gradient-sync passes and of context parallelism, validated once with readable errors."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch

MODES = ("tied_first", "shard_aligned", "unsafe_rs_first")
PLACEMENTS = ("auto", "tied_at_flush", "backward", "flush")
DEPRECATED_PLACEMENTS = {"split": "tied_at_flush"}  # old spelling -> its name now
COMPILERS = ("inductor", "eager")
ACCUMULATE = ("fp32", "input", "fp32_blocks")
COMMS = ("ring", "allgather", "a2a", "hybrid", "auto")
LOAD_BALANCE = (True, False, "documents")
SHARDS = (True, False, "params")
ON_NONFINITE = ("raise", "skip")
TP_ROLES = ("column", "row", "replicated")  # what tp_plan may give a module
# The one list of each option's values: the context-parallel modules import them from here.


@dataclass
class SyncOptions:
    """What the gradient-sync passes build.

    mode       tied_first: all-reduce tied gradients over the tie group, then
                 reduce over data parallel (always correct).
               shard_aligned: reduce-scatter first, then all-reduce only the owned
                 shard of the tied gradient (dp x fewer bytes); runs only if the
                 verifier proves every tie-group member shards it identically.
               unsafe_rs_first: Megatron-LM #844's order, kept to demonstrate the
                 hazard; refused unless allow_hazard=True.
    shard      True: reduce-scatter buckets (distributed optimizer); False: all-reduce.
               "params": as True, and the parameters too live as this rank's shard of their
                 bucket, all-gathered in each graph just before use (ZeRO-3 / FSDP);
                 reshard_after_forward=False keeps the forward's gathered parameters the
                 backward reads instead of gathering them again.
    placement  where each bucket's reduction runs. tied_at_flush (auto's choice for pp > 1):
                 buckets without a tied gradient in the last micro-batch's backward
                 graph, overlapping the other stages' remaining work; buckets with
                 one in a sync graph after the pipeline flush (a stage's backward
                 cannot wait on other stages before it has sent its input gradient).
               backward (auto's choice for pp == 1): every bucket in the backward;
                 refused with ties across stages.
               flush: every bucket after the flush.
    """
    mode: str = "tied_first"
    shard: bool | str = True
    reshard_after_forward: bool = True  # shard="params" only
    bucket_mb: float = 25.0
    reduce_dtype: torch.dtype | None = None  # e.g. torch.float32 to reduce bf16 grads in fp32
    average: bool = True
    microbatches: int = 1
    placement: str = "auto"
    compiler: str = "inductor"
    allow_hazard: bool = False
    check_ranks: bool = True  # exchange collective fingerprints before the first collective
    # tp > 1, for debugging: after each optimizer step every TP-replicated parameter is bitwise equal over TP, or
    # the step raises naming the first that is not (gradsched.tp.replica_check); an all-gather of them a step
    check_tp_replicas: bool = False
    # tp > 1: the roles the tensor-parallel pass finds, overridden by module name ({pattern: role}, fnmatch
    # patterns such as "model.layers.*.mlp.down_proj", the first that matches wins): "column", "row", or
    # "replicated" (the module whole on every TP rank); the pass still refuses a layout it cannot compute exactly
    tp_plan: dict | None = None
    # seconds an eager collective may wait while every peer of its group is alive and waiting too (a collective
    # issued on some ranks only): then each stalled rank names every peer's position and exits (gradsched.sync.watchdog)
    fault_timeout_s: float = 30.0
    # the same for a rank that is compiling (its first step, a recompile) or writing a checkpoint: peers waiting
    # for it meanwhile give it this long before they name it (gradsched.sync.stuck)
    compile_timeout_s: float = 600.0
    dump_dir: str | None = None
    # a step whose loss or gradients went non-finite on any rank is never applied (gradsched.sync.nonfinite):
    # "raise" ends the run on every rank naming where it began; "skip" skips the step on every rank
    on_nonfinite: str = "raise"
    # context parallelism (plan.cp > 1): how attention is lowered into ring steps
    accumulate: str = "fp32"  # "fp32" | "input" | "fp32_blocks"
    # "ring" (p2p K/V rotation) | "allgather" | "a2a" (Ulysses: heads, gradsched.cp.ulysses) | "hybrid" (a2a over
    # groups of a2a_degree consecutive CP ranks x ring over the rest) | "auto" (gradsched.cp.comm picks per call)
    comm: str = "ring"
    a2a_degree: int | None = None  # comm="hybrid" only; None: the largest the heads allow
    # causal layout (gradsched.cp.layout): True: rank r holds chunks r and 2cp-1-r; False: chunk r;
    # "documents": each batch row first reordered so every rank holds a share of every packed document
    load_balance: bool | str = True

    def __post_init__(self):
        def bad(name, value, allowed):
            raise ValueError(f"gradsched option {name}={value!r} is not one of {allowed}.")
        if not any(self.shard is v or self.shard == v and isinstance(v, str) for v in SHARDS):
            bad("shard", self.shard, SHARDS)
        if not self.reshard_after_forward and self.shard != "params":
            raise ValueError("gradsched option reshard_after_forward=False is for shard='params' (parameters "
                             f"sharded); shard is {self.shard!r}.")
        if self.mode not in MODES:
            bad("mode", self.mode, MODES)
        if self.placement in DEPRECATED_PLACEMENTS:  # an old spelling: still valid, told once where it is written
            new = DEPRECATED_PLACEMENTS[self.placement]
            warnings.warn(f"gradsched option placement={self.placement!r} is now spelled placement={new!r} (the "
                          f"word 'split' means the pipeline split); the old name will be removed.", FutureWarning,
                          stacklevel=3)
            self.placement = new
        if self.placement not in PLACEMENTS:
            bad("placement", self.placement, PLACEMENTS)
        if self.compiler not in COMPILERS:
            bad("compiler", self.compiler, COMPILERS)
        if self.accumulate not in ACCUMULATE:
            bad("accumulate", self.accumulate, ACCUMULATE)
        if self.on_nonfinite not in ON_NONFINITE:
            bad("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        if self.comm not in COMMS:
            bad("comm", self.comm, COMMS)
        if not (isinstance(self.load_balance, bool) or self.load_balance == "documents"):
            bad("load_balance", self.load_balance, LOAD_BALANCE)
        if self.a2a_degree is not None and self.comm != "hybrid":
            raise ValueError(f"gradsched option a2a_degree={self.a2a_degree} is for comm='hybrid' (comm is "
                             f"{self.comm!r}): set comm='hybrid', or leave a2a_degree unset.")
        if self.a2a_degree is not None and self.a2a_degree < 1:
            raise ValueError(f"gradsched option a2a_degree={self.a2a_degree} must be >= 1 (a divisor of cp).")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"gradsched option compile_timeout_s={self.compile_timeout_s} must be > 0 (seconds).")
        if not self.fault_timeout_s > 0:
            raise ValueError(f"gradsched option fault_timeout_s={self.fault_timeout_s} must be > 0 (seconds).")
        if self.bucket_mb <= 0:
            raise ValueError(f"gradsched option bucket_mb={self.bucket_mb} must be > 0.")
        for pattern, role in (self.tp_plan or {}).items():
            if not isinstance(pattern, str) or role not in TP_ROLES:
                raise ValueError(f"gradsched option tp_plan={{{pattern!r}: {role!r}}}: a module-name pattern "
                                 f"(a str) and one of {TP_ROLES}.")
        if self.microbatches < 1:
            raise ValueError(f"gradsched option microbatches={self.microbatches} must be >= 1.")
        if self.mode != "tied_first" and not self.shard:
            raise ValueError(
                f"mode={self.mode!r} orders the tie all-reduce against a reduce-scatter, so it needs "
                "shard=True (distributed optimizer); with all-reduce buckets use mode='tied_first'.")

    @classmethod
    def from_dict(cls, d: dict | None) -> "SyncOptions":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown gradsched option(s) {unknown}; known: {sorted(known)}.")
        return cls(**d)
