"""The distributed optimizer: each data-parallel rank steps a torch.optim optimizer over its shards.

The sync graph leaves, per bucket, this rank's reduced gradient shard. The optimizer
holds an fp32 master copy (float64 for a float64 parameter: `master_dtype`) of each piece of a parameter that the shard holds
(gradsched.training.shards), steps them with the wrapped torch.optim optimizer, one parameter
group per set of options (gradsched.training.param_groups), then all-gathers the buckets in the
parameters' dtype and writes the parameters back; under shard="params", where the parameters
live as shards, it writes this rank's shards and nothing is gathered. Only elementwise optimizers give on
pieces what they give on whole tensors, so only those are accepted (ELEMENTWISE).
Tied copies receive identical gradients and options, so they stay equal.

With shard=False (plain data parallel) the reduced gradients are already in .grad and
the optimizer is an ordinary one over the full parameters, grouped the same way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gradsched.training.param_groups import options_by_name
from gradsched.training.shards import owned_pieces
from gradsched.sync import nonfinite
from gradsched.sync.param_shards import all_gather
from gradsched.training.model_state import find_sync, options_of, state_of, unsplit_module
from gradsched.sync.stage_setup import process_group
from gradsched.sync.watchdog import JOURNAL
from gradsched.tp.replica_check import check_tp_replicas

# Their update of an element reads only that element's gradient, state and value: stepping a
# rank's pieces equals stepping the whole tensors. (Adafactor, LBFGS, SparseAdam, Muon and the
# like read whole tensors or rows: not on shards.)
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, n))


def _all_gather(out, x, group):  # a name of this module's: tests delay or break it here
    return all_gather(out, x, group, async_op=True)


class DistributedOptimizer:
    """DistributedOptimizer(model, torch.optim.AdamW, lr=..., param_groups=None, ...).

    param_groups: None (one group), a function (name, parameter) -> options, or torch-style
    groups listing names or Parameters (see gradsched.training.param_groups)."""

    def __init__(self, model, optimizer_class, param_groups=None, **optimizer_kwargs):
        if isinstance(optimizer_class, torch.optim.Optimizer):
            n = sum(len(g["params"]) for g in optimizer_class.param_groups)
            raise TypeError(
                f"DistributedOptimizer got an already built {type(optimizer_class).__name__} over {n} full "
                "parameter tensors; a distributed optimizer steps only this rank's shards, which exist after "
                "the first backward. Pass the class and its arguments: "
                f"DistributedOptimizer(model, torch.optim.{type(optimizer_class).__name__}, lr=...).")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"DistributedOptimizer needs a torch.optim.Optimizer class, got {optimizer_class!r}.")
        options = options_of(model)  # a parallel model's: say it now, not at the first step
        if getattr(options, "shard", False) and not issubclass(optimizer_class, ELEMENTWISE):
            _refuse_non_elementwise(optimizer_class)
        self.model = model
        self.optimizer_class, self.kwargs, self.param_groups = optimizer_class, optimizer_kwargs, param_groups
        self.optimizer = None
        self.pieces = []  # this rank's pieces of the parameters (gradsched.training.shards.Piece), in layout order
        self.masters: list[torch.nn.Parameter] = []  # their fp32 master copies, in the same order
        self.restore_from = None  # restore_from(optimizer, sync): gradsched.load sets it, the build calls it
        self.skipped_steps = 0  # steps not applied: their gradients went non-finite (on_nonfinite="skip")
        self.applied_steps = 0
        # per bucket, what the parameter all-gather reads and writes (or, one shard a bucket, the parameters'
        # pieces written directly), made at the first step after each build
        self._gathers = None

    @property
    def sync(self):
        """The GradSync reducing the model's gradients: a ParallelModel's (built at its first step), or,
        for torch.compile(model, backend="gradsched"), the one the backend attached to its parameters."""
        sync = find_sync(self.model)
        if sync is None or sync.sync_plan is None:
            raise RuntimeError("DistributedOptimizer.step() before the model's first forward and backward: the "
                               "gradient shards are laid out by the first backward graph.")
        return sync

    def _options(self, sync) -> dict[str, dict]:
        copies = {}
        for name, tie in sync.setup.ties.items():
            copies.setdefault(name, []).extend(n for _, n in tie.members)
        for names in sync.setup.aliases:
            for n in names:
                copies.setdefault(n, []).extend(sorted(names))
        copies = {n: sorted(set(c) | {n}) for n, c in copies.items()}
        return options_by_name(self.param_groups, sync.params, copies, unsplit_named_parameters(self.model))

    def build(self):
        """Lay out this rank's master pieces and the wrapped optimizer (the first step does it)."""
        sync = self.sync
        plan, params = sync.sync_plan, sync.params
        options = self._options(sync)
        self._gathers = None
        if not plan.shard:
            self.optimizer = self.optimizer_class(_groups(list(params), options, params.__getitem__), **self.kwargs)
            self.optimizer._gradsched_asked = True  # step() asks the non-finite verdict itself (owners' hook: not again)
            self._restore(sync)
            return
        if not issubclass(self.optimizer_class, ELEMENTWISE):
            _refuse_non_elementwise(self.optimizer_class)
        self.pieces = owned_pieces(plan.layout, plan.grad_group.index)
        shards = sync.param_shards if plan.params_sharded else None  # the parameters' storage is released
        self.masters = [torch.nn.Parameter(_master(shards, pc, params)) for pc in self.pieces]
        self.optimizer = self.optimizer_class(
            _groups(range(len(self.pieces)), {i: options[pc.name] for i, pc in enumerate(self.pieces)},
                    self.masters.__getitem__), **self.kwargs)
        self._restore(sync)

    def _restore(self, sync) -> None:
        if self.restore_from is not None:  # a checkpoint was loaded: its masters and state, for this layout
            restore, self.restore_from = self.restore_from, None
            restore(self, sync)

    @torch.no_grad()
    def step(self, lr_scale: float | None = None) -> bool:
        """One optimizer step over this step's reduced gradients. lr_scale: a schedule's factor on every
        group's learning rate (the rate it was built with), e.g. warmup and cosine decay.

        A step whose loss or gradients went non-finite on any rank is never applied (gradsched.sync.nonfinite):
        NonFiniteError on every rank, or with on_nonfinite="skip" the step is dropped on every rank, the
        optimizer's state untouched. Returns whether the step was applied."""
        if self.optimizer is None:
            self.build()
        sync = self.sync
        plan = sync.sync_plan
        reduced = sync.reduced()
        if plan.shard and len(reduced) != len(plan.layout.buckets):
            raise RuntimeError("DistributedOptimizer.step() before this step's gradients were reduced: run the "
                               "step's backward passes (and flush() under pipeline parallelism) first.")
        if not nonfinite.check(sync, sync.options.on_nonfinite):
            self.skipped_steps += 1
            sync.clear_results()
            for p in sync.params.values():
                p.grad = None
            return False
        if lr_scale is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = g.setdefault("base_lr", g["lr"]) * lr_scale
        if not plan.shard:
            self.optimizer.step()
            return self._applied(sync)
        for pc, master in zip(self.pieces, self.masters):
            master.grad = reduced[pc.bucket][pc.at:pc.at + pc.numel].to(master.dtype)
        self.optimizer.step()
        if plan.params_sharded:  # the parameters are the shards: the next graphs gather them
            for pc, master in zip(self.pieces, self.masters):
                if master.dtype != sync.param_shards.shards[pc.bucket].dtype:  # shards in it are the masters
                    sync.param_shards.write(pc.bucket, pc.at, master.detach())
        else:
            self._gather(sync)
            if state_of(self.model) is None:  # compiled by backend name: its user reads the parameters' tensors
                sync.finish_param_gather()  # directly, where nothing lands the gather first (a parallel model does)
        return self._applied(sync)

    def _applied(self, sync) -> bool:
        sync.clear_results()
        self.applied_steps += 1
        if sync.options.check_tp_replicas:
            check_tp_replicas(sync, self.applied_steps)
        return True

    def _gather(self, sync) -> None:
        """Write the stepped masters back into every rank's parameters: per bucket, this rank's shard
        in the plan's gather dtype (the parameters' own: bf16 is half the bytes of fp32), all-gathered.
        Off the critical path, as FSDP2 and Megatron's overlap_param_gather do: each bucket's all-gather is
        issued without waiting; its wait, and its copy into the parameters, come when something next reads
        them (GradSync.finish_param_gather: the next forward graph, a checkpoint, full_parameters)."""
        sync.finish_param_gather()  # two steps without a forward between: the first's gather lands first
        plan, params = sync.sync_plan, sync.params
        pg, shards = process_group(plan.grad_group), len(plan.grad_group.ranks)
        if self._gathers is None:  # made once a build: views and buffers made every step cost host time
            if shards == 1 and all(params[pc.name].is_contiguous() for pc in self.pieces):
                # this rank holds every piece: written straight into the parameters (a gather would copy each
                # bucket three times: half of a pp-only step's optimizer time on a CPU)
                self._gathers = [params[pc.name].detach().view(-1)[pc.lo:pc.hi] for pc in self.pieces]
            else:
                self._gathers = _gather_buffers(plan, params, self.pieces, self.masters, shards)
        if self._gathers and isinstance(self._gathers[0], torch.Tensor):  # the direct writes
            torch._foreach_copy_(self._gathers, self.masters)
            return
        issued = []
        for g in self._gathers:
            if g.sources:  # one call for the bucket's pieces (a copy each, cast to the gather dtype)
                torch._foreach_copy_(g.pieces, g.sources)
            with JOURNAL.entry(_gather_name(g), "collective", pg, "all_gather", g.full.numel(), g.full.dtype):
                issued.append((g, _all_gather(g.full, g.mine, pg)))
        sync.pending_gather = lambda: _land(issued, pg)

    def finish_param_gather(self) -> None:
        """Under shard=True, for a parallel model, the step's parameter all-gather is still in flight when step()
        returns; the next forward, a checkpoint, its parameters() or state_dict() land it. Code reading the
        parameters' tensors directly in between calls this first. A wait, no new collective. (A model compiled by
        backend name has its gather landed by step() itself.)"""
        sync = find_sync(self.model)
        if sync is not None:
            sync.finish_param_gather()

    def zero_grad(self, set_to_none: bool = True):
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)
        sync = find_sync(self.model)
        # the trained parameters (a model's parameters() walks its modules and ties: ~0.5 ms a step here)
        for p in (sync.params.values() if sync is not None and sync.built is not None else self.model.parameters()):
            p.grad = None

    def state_dict(self):
        raise NotImplementedError(
            "DistributedOptimizer keeps its state in pieces of flat gradient buckets, whose layout depends on "
            "pp, dp, cp and bucket_mb: a torch state dict of them could not be loaded elsewhere. Use "
            "gradsched.save(path, model, optimizer, step=...) and gradsched.load(path, model, optimizer): "
            "keyed by parameter name, loadable at any layout.")

    def load_state_dict(self, state):
        self.state_dict()  # the same answer


def _gather_name(g) -> str:
    return f"the optimizer's parameter all-gather, bucket {g.index}"


@torch.no_grad()
def _land(issued: list, pg) -> None:
    """Wait for each bucket's all-gather in issue order and copy it into the parameters (a bucket's copy
    overlaps the later buckets' gathers still in flight)."""
    for g, work in issued:
        if work is not None:  # None: done already (a synchronous gather)
            with JOURNAL.entry(_gather_name(g), "collective", pg, "all_gather", g.full.numel(), g.full.dtype):
                work.wait()
        torch._foreach_copy_(g.slots, g.views)


class _BucketGather:
    """One bucket's parameter all-gather, its buffers and views made once (the masters and parameters are
    fixed until the optimizer is built again): this rank's shard in the gather dtype (`mine`, its padding zero),
    the gathered bucket (`full`), and the copies into and out of them."""
    def __init__(self, b, dtype, shards: int, pieces: list, params: dict):
        device = params[b.slots[0].name].device
        self.index = b.index
        self.mine = torch.zeros(b.shard_numel(shards), dtype=dtype, device=device)  # padding stays zero
        self.full = torch.empty(b.numel, dtype=dtype, device=device)
        self.pieces = [self.mine[pc.at:pc.at + pc.numel] for pc, _ in pieces]
        self.sources = [m for _, m in pieces]
        self.slots = [params[s.name] for s in b.slots]
        self.views = [self.full[s.offset:s.offset + s.numel].view(p.shape) for s, p in zip(b.slots, self.slots)]


def _gather_buffers(plan, params: dict, pieces: list, masters: list, shards: int) -> list[_BucketGather]:
    by_bucket = {}
    for pc, master in zip(pieces, masters):
        by_bucket.setdefault(pc.bucket, []).append((pc, master))
    return [_BucketGather(b, dtype, shards, by_bucket.get(b.index, []), params)
            for b, dtype in zip(plan.layout.buckets, plan.gather_dtypes)]


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """A master weight's dtype: fp32 for fp32 and lower-precision parameters; a float64 model keeps float64 (fp32
    masters would round every step's update: 2.7e-7 from one float64 process after three AdamW steps)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _master(shards, pc, params) -> torch.Tensor:
    """The master of piece `pc`: under shard="params", a view of a shard already in the master dtype (the
    optimizer then steps the parameters' only copy in place: no second copy), or a copy of a lower-precision one;
    otherwise a copy of the parameter's elements."""
    if shards is None:
        p = params[pc.name]
        return p.detach().reshape(-1)[pc.lo:pc.hi].to(master_dtype(p.dtype), copy=True)
    piece = shards.shards[pc.bucket][pc.at:pc.at + pc.numel]
    return piece if piece.dtype == master_dtype(piece.dtype) else piece.to(master_dtype(piece.dtype))


def _refuse_non_elementwise(cls):
    raise TypeError(
        f"{cls.__name__} is not an elementwise optimizer: the distributed optimizer steps each rank's shard "
        "of every parameter on its own, which gives the unsharded result only when an element's update "
        f"reads nothing but that element ({', '.join(c.__name__ for c in ELEMENTWISE)}). Use one of those, or "
        "shard=False (plain data parallel: every rank steps whole parameters).")


def _groups(keys, options: dict, tensor_of) -> list[dict]:
    """torch.optim param groups: one per distinct set of options, in first-use order."""
    groups: dict[str, dict] = {}
    for k in keys:
        opts = options[k]
        g = groups.setdefault(repr(sorted(opts.items())), {**opts, "params": []})
        g["params"].append(tensor_of(k))
    return list(groups.values())


def unsplit_named_parameters(model) -> list:
    """The unsplit model's parameters under every name (ties included), as the user built it."""
    return list(unsplit_module(model).named_parameters(remove_duplicate=False))
