"""What a checkpoint holds, as DCP entries, and how this rank's tensors map onto them.

Names: a parameter under its first name in the unsplit model (canonical_names); a tied copy is
written by the first stage of its tie, and the stale copies pipelining's split leaves are never
read or written (skipped). The optimizer's master weights and per-element state are written as
pieces of the flattened parameter (a ShardedTensor over the gradient group's pieces), so any
layout reads whatever saved pieces overlap its own (restore_into). dcp_call turns DCP's
CheckpointException (a BaseException) into a CheckpointError naming the checkpoint.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gradsched.sync.stage_setup import process_group
from gradsched.sync.watchdog import JOURNAL, CollectiveFault, is_comm_error, peers_report
from gradsched.training.checkpoint_files import CheckpointError
from gradsched.training.materialize import first_names
from gradsched.training.model_state import find_sync, stale_names, trained_module, unsplit_module
from gradsched.training.optimizer import master_dtype
from gradsched.training.shards import owned_pieces


@contextlib.contextmanager
def pieces_api():
    """DCP declares uneven pieces of a tensor through ShardedTensor, which torch deprecates in favour
    of DTensor; DTensor's shards sit at fixed, even positions, which bucket pieces do not. Its
    FutureWarning says nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def dcp_call(doing: str, where: str, fn):
    """fn() (a DCP call), with DCP's failures as a CheckpointError naming `where`: DCP raises
    CheckpointException, a BaseException that `except Exception` misses, on every rank alike."""
    try:
        with JOURNAL.entry(f"{doing} the checkpoint at {where!r} (DCP's collectives)", "io"):
            return fn()
    except CheckpointException as e:
        why = "; ".join(f"rank {r}: {type(exc).__name__}: {_first_line(exc)}"
                        for r, (exc, _) in sorted(e.failures.items()))
        peers = peers_report() if any(is_comm_error(exc) for exc, _ in e.failures.values()) else ""
        raise CheckpointError(f"{doing} the checkpoint at {where!r} failed: {why}."
                              + (f" The peers: {peers}." if peers else "")) from None
    except CollectiveFault as e:
        raise CheckpointError(f"{doing} the checkpoint at {where!r} failed: {e}") from e
    except Exception as e:  # before DCP's collectives (reading .metadata, planning): this rank's own error
        raise CheckpointError(f"{doing} the checkpoint at {where!r} failed: {type(e).__name__}: "
                              f"{_first_line(e)}.") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


# ---- names ------------------------------------------------------------------------------------

def canonical_names(model) -> dict[str, str]:
    """Every name of a parameter in the unsplit model -> its first name (what checkpoints use); a buffer's -> itself."""
    return first_names(unsplit_module(model))


def _skipped(model, writing: bool) -> set[str]:
    """Names this rank holds but does not write (writing=True) or read: the stale copies pipelining's
    split leaves; when writing, also tied copies whose tie begins on another stage (that stage
    writes them; every copy reads them)."""
    skip = set(stale_names(model))
    sync = find_sync(model)
    if sync is not None and writing:
        skip |= {n for n, t in sync.setup.ties.items() if min(t.stages) != sync.setup.stage}
    return skip


def model_tensors(model, writing: bool) -> dict[str, torch.Tensor]:
    """name in the checkpoint -> this rank's tensor (parameters and persistent buffers) to write or
    to read into."""
    canon, skip = canonical_names(model), _skipped(model, writing)
    meta = [k for k, v in trained_module(model).state_dict(keep_vars=True).items() if v.is_meta]
    if meta:  # a load would copy into nothing, and the first step's initialization would then overwrite it
        raise CheckpointError(f"the model's {meta[0]} (and {len(meta) - 1} more) is still on the meta device: a model "
                              "built on meta is allocated and initialized at its first train_step, or by "
                              "model.allocate(inputs, targets): save or load after either.")
    # the unsplit model's state dict is the contract: a split stage may hold more (pipelining
    # makes non-persistent buffers, such as rotary inv_freq, part of a stage's state)
    known = set(trained_module_names_all(model))
    out = {canon.get(k, k): v for k, v in trained_module(model).state_dict(keep_vars=True).items() if k not in skip}
    sync = find_sync(model)
    if writing and sync is not None and sync.param_shards is not None:  # shard="params": the values, gathered
        full = sync.full_parameters()
        by_id = {id(p): full[n] for n, p in sync.params.items()}
        out = {k: by_id.get(id(v), v) for k, v in out.items()}
    return {k: v for k, v in out.items() if k in known}


def sharded_parameter_names(model) -> dict[int, str]:
    """id(parameter) -> name, for the parameters that live as shards (shard="params", once laid out)."""
    sync = find_sync(model)
    if sync is None or sync.param_shards is None:
        return {}
    return {id(p): n for n, p in sync.params.items()}


# ---- pieces as DCP sees them ----------------------------------------------------------------

def _sharded(name_numel: int, pieces_by_rank: list[tuple[int, int, int]], mine: dict, dtype, device):
    """A DCP-shardable view of one flattened tensor: pieces_by_rank [(global rank, lo, hi)], and
    mine {(lo, hi): this rank's tensor of that piece}."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    me = dist.get_rank()
    md = [ShardMetadata([lo], [hi - lo], f"rank:{r}/{device}") for r, lo, hi in pieces_by_rank]
    local = [Shard(mine[(lo, hi)], ShardMetadata([lo], [hi - lo], f"rank:{r}/{device}"))
             for r, lo, hi in pieces_by_rank if r == me]
    meta = ShardedTensorMetadata(md, torch.Size([name_numel]), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def _pieces_by_name(plan) -> dict[str, list[tuple[int, int, int]]]:
    """parameter name -> [(global rank, lo, hi)] over every rank of the gradient group."""
    pg = process_group(plan.grad_group)
    out: dict[str, list] = {}
    for k in range(len(plan.grad_group.ranks)):
        for pc in owned_pieces(plan.layout, k):
            out.setdefault(pc.name, []).append((dist.get_global_rank(pg, k), pc.lo, pc.hi))
    return out


def optimizer_entries(model, optimizer) -> dict:
    """optim/<name>/<state> entries of this rank (empty before the optimizer's first step)."""
    if optimizer is not None and optimizer.restore_from is not None:
        raise CheckpointError(
            "gradsched.save after gradsched.load, before the model's first step: the loaded optimizer state "
            "is read for this layout only once the first backward has laid out the gradient shards, so it "
            "cannot be written yet. Checkpoints load at any layout as they are: no conversion is needed; or "
            "save after a train_step.")
    if optimizer is None or optimizer.optimizer is None:
        return {}
    sync = find_sync(model)
    plan, canon, skip = sync.sync_plan, canonical_names(model), _skipped(model, writing=True)
    out = {}
    if not plan.shard:  # whole parameters: a plain optimizer over them
        for name, p in sync.params.items():
            if name in skip:
                continue
            key = f"optim/{canon.get(name, name)}"
            out[f"{key}/master"] = p.detach().to(master_dtype(p.dtype)).reshape(-1)
            for k, v in optimizer.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"{key}/{k}"] = v.reshape(-1) if v.dim() else v
        return out
    everyone = _pieces_by_name(plan)
    by_name: dict[str, list] = {}
    for pc, master in zip(optimizer.pieces, optimizer.masters):
        by_name.setdefault(pc.name, []).append((pc, master))
    state_keys = _state_keys(optimizer, plan)
    for name in sorted(everyone):
        if name in skip:
            continue
        numel, key = sync.params[name].numel(), f"optim/{canon.get(name, name)}"
        mine = by_name.get(name, [])
        device = sync.params[name].device
        out[f"{key}/master"] = _sharded(numel, everyone[name], {(pc.lo, pc.hi): m.detach() for pc, m in mine},
                                        torch.float32, device)
        states = {}
        for pc, m in mine:
            for k, v in optimizer.optimizer.state.get(m, {}).items():
                if isinstance(v, torch.Tensor) and v.dim():
                    states.setdefault(k, {})[(pc.lo, pc.hi)] = v
                elif isinstance(v, torch.Tensor):
                    out[f"{key}/{k}"] = v  # scalar (step): the same on every piece
        for k in state_keys:
            out[f"{key}/{k}"] = _sharded(numel, everyone[name], states.get(k, {}), torch.float32, device)
    return out


def _state_keys(optimizer, plan) -> list[str]:
    """The per-element state names (exp_avg, ...), agreed over the gradient group: a rank holding
    no piece of a parameter still declares the key (DCP plans every key on every rank alike)."""
    mine = sorted({k for s in optimizer.optimizer.state.values() for k, v in s.items()
                   if isinstance(v, torch.Tensor) and v.dim()})
    got = [None] * len(plan.grad_group.ranks)
    dist.all_gather_object(got, mine, group=process_group(plan.grad_group))
    return sorted({k for g in got for k in g})


def trained_module_names_all(model) -> dict[str, torch.Tensor]:
    """Every name the whole unsplit model saves under (every stage's), with its tensor."""
    canon = canonical_names(model)
    return {canon.get(k, k): v for k, v in unsplit_module(model).state_dict(keep_vars=True).items()}


def restore_into(optimizer, sync, where: str, md) -> None:
    """Give a freshly built DistributedOptimizer the saved master weights and state for this rank's
    layout. Collective (DCP reads): every rank calls it, from its optimizer's first build."""
    plan, canon = sync.sync_plan, canonical_names(optimizer.model)
    saved: dict[str, list[str]] = {}
    for k in md:
        if k.startswith("optim/"):
            name, state = k[len("optim/"):].rsplit("/", 1)
            saved.setdefault(name, []).append(state)
    missing = sorted({canon.get(n, n) for n in sync.params} - set(saved))
    if missing:
        raise CheckpointError(f"the checkpoint at {where!r} has no optimizer state for {missing[:8]}.")
    request = {}
    if plan.shard:
        everyone = _pieces_by_name(plan)
        for name in sorted(everyone):
            key, numel, device = canon.get(name, name), sync.params[name].numel(), sync.params[name].device
            mine = [pc for pc in optimizer.pieces if pc.name == name]
            for state in saved[key]:
                m = md[f"optim/{key}/{state}"]
                if len(m.size) == 0:  # scalar state: read by the ranks that step a piece of it
                    if mine:
                        request[f"optim/{key}/{state}"] = torch.zeros((), dtype=m.properties.dtype,
                                                                      device=_scalar_device(optimizer, device))
                    continue
                request[f"optim/{key}/{state}"] = _sharded(
                    numel, everyone[name],
                    {(pc.lo, pc.hi): torch.zeros(pc.numel, dtype=torch.float32, device=device) for pc in mine},
                    torch.float32, device)
    else:
        for name, p in sync.params.items():
            key = canon.get(name, name)
            for state in saved[key]:
                m = md[f"optim/{key}/{state}"]
                request[f"optim/{key}/{state}"] = torch.zeros(m.size, dtype=m.properties.dtype, device=p.device)
    with pieces_api():
        dcp_call("loading the optimizer's state from", where, lambda: dcp.load(request, checkpoint_id=where))
    got = {k: (_local_pieces(v) if hasattr(v, "local_shards") else v) for k, v in request.items()}
    with torch.no_grad():
        if plan.shard:
            for pc, master in zip(optimizer.pieces, optimizer.masters):
                key, where_ = canon.get(pc.name, pc.name), (pc.lo, pc.hi)
                master.copy_(got[f"optim/{key}/master"][where_])
                optimizer.optimizer.state[master] = {
                    s: (got[f"optim/{key}/{s}"][where_] if isinstance(got[f"optim/{key}/{s}"], dict)
                        else got[f"optim/{key}/{s}"]).clone()
                    for s in saved[key] if s != "master"}
        else:
            for name, p in sync.params.items():
                key = canon.get(name, name)
                optimizer.optimizer.state[p] = {
                    s: (v.view(p.shape) if v.dim() else v).clone()
                    for s in saved[key] if s != "master" for v in [got[f"optim/{key}/{s}"]]}


def _scalar_device(optimizer, device):
    """Where torch keeps a scalar state such as Adam's step: on the parameters' device when the
    optimizer is capturable or fused, else on the host."""
    d = optimizer.optimizer.defaults
    return device if d.get("capturable") or d.get("fused") else torch.device("cpu")


def _local_pieces(st) -> dict:
    return {(s.metadata.shard_offsets[0], s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0]): s.tensor
            for s in st.local_shards()}
