"""Checkpoints that do not depend on the layout, through torch.distributed.checkpoint (DCP).

    gradsched.save("ckpt", model, optimizer, step=step, data_position=batches_seen)
    meta = gradsched.load("ckpt", model, optimizer)   # before or after the first step
    meta["step"], meta["data_position"]

What is saved, by the parameter's name in the unsplit model (a tied weight under its first
name, written by the first stage of its tie):
  model/<name>             parameters and buffers, whole; a tensor several ranks hold (the
                           ranks of one stage) is written once
  optim/<name>/master      the fp32 master weights, flattened
  optim/<name>/<state>     the optimizer's state of that parameter (exp_avg, exp_avg_sq, ...),
                           flattened; scalar state (step) whole
  meta/step, meta/data_position, meta/optimizer (the optimizer class's name, as bytes)
Each rank writes only the pieces of the parameters its shards hold (gradsched.shards),
declared to DCP as pieces of the flattened parameter: nothing is gathered, and loading
reads, for each piece of the new layout, whatever saved pieces overlap it. So a run saved
at pp2 x dp2 loads at pp1 x dp4 or with another bucket_mb.

Atomic: a save is written to <path>/step-<N>.partial, and only after every rank has
finished is it renamed to <path>/step-<N> and named in <path>/latest (rewritten by a
rename). A crash mid-save leaves the last good checkpoint where `latest` says.

Loading checks the checkpoint against the model before reading anything: missing,
extra or reshaped parameters and another optimizer class are refused by name. The
optimizer's state is read when the optimizer builds its shards (its first step), since
only then is the layout known; the model's parameters are read at once.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .optimizer import unsplit_module, unsplit_named_parameters
from .runtime import find_sync
from .shards import owned_pieces
from .stage_setup import process_group

LATEST = "latest"


@contextlib.contextmanager
def _pieces_api():
    """DCP declares uneven pieces of a tensor through ShardedTensor, which torch deprecates in favour
    of DTensor; DTensor's shards sit at fixed, even positions, which bucket pieces do not. Its
    FutureWarning says nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model and optimizer."""


# ---- names ------------------------------------------------------------------------------------

def canonical_names(model) -> dict[str, str]:
    """Every name of a parameter in the unsplit model -> its first name (what checkpoints use)."""
    first: dict[int, str] = {}
    out = {}
    for n, p in unsplit_named_parameters(model):
        out[n] = first.setdefault(id(p), n)
    return out


def _trained_module(model):
    """The module whose tensors this rank trains: its stage (under pp > 1, once built), else the model."""
    from .parallel import ParallelModel
    if isinstance(model, ParallelModel) and model.module is not None:
        return model.stage_module
    return unsplit_module(model)


def _skipped(model, writing: bool) -> set[str]:
    """Names this rank holds but does not write (writing=True) or read: the stale copies pipelining's
    split leaves; when writing, also tied copies whose tie begins on another stage (that stage
    writes them; every copy reads them)."""
    from .parallel import ParallelModel
    skip = set(model._stale_names()) if isinstance(model, ParallelModel) and model.module is not None else set()
    sync = find_sync(model)
    if sync is not None and writing:
        skip |= {n for n, t in sync.setup.ties.items() if min(t.stages) != sync.setup.stage}
    return skip


def _model_tensors(model, writing: bool) -> dict[str, torch.Tensor]:
    """name in the checkpoint -> this rank's tensor (parameters and persistent buffers) to write or
    to read into."""
    canon, skip = canonical_names(model), _skipped(model, writing)
    # the unsplit model's state dict is the contract: a split stage may hold more (pipelining
    # makes non-persistent buffers, such as rotary inv_freq, part of a stage's state)
    known = set(_trained_module_names_all(model))
    out = {canon.get(k, k): v for k, v in _trained_module(model).state_dict(keep_vars=True).items() if k not in skip}
    return {k: v for k, v in out.items() if k in known}


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


def _optimizer_entries(model, optimizer) -> dict:
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
            out[f"{key}/master"] = p.detach().float().reshape(-1)
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


# ---- save ------------------------------------------------------------------------------------

def save(path: str, model, optimizer=None, *, step: int, data_position: int | None = None) -> str:
    """Save the model, the optimizer and the position of the run; every rank calls it. Returns the
    checkpoint's directory. Atomic: until every rank has written, `latest` names the previous one."""
    rank = dist.get_rank()
    final = os.path.join(path, f"step-{step:08d}")
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save of this step
    dist.barrier()
    state = {f"model/{k}": v.detach() for k, v in _model_tensors(model, writing=True).items()}
    state["meta/step"] = torch.tensor(step, dtype=torch.int64, device="cpu")
    state["meta/data_position"] = torch.tensor(step if data_position is None else data_position, dtype=torch.int64,
                                                 device="cpu")
    if optimizer is not None:
        state["meta/optimizer"] = _encode(optimizer.optimizer_class.__name__)
    with _pieces_api():
        state.update(_optimizer_entries(model, optimizer))
        dcp.save(state, checkpoint_id=partial)
    dist.barrier()  # every rank has written its pieces, and rank 0 the metadata
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        tmp = os.path.join(path, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(final))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, LATEST))
    dist.barrier()
    return final


def _encode(s: str) -> torch.Tensor:
    return torch.tensor(list(s.encode()), dtype=torch.uint8, device="cpu")  # host metadata


def _decode(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode()


# ---- load ------------------------------------------------------------------------------------

def checkpoint_dir(path: str) -> str:
    """The checkpoint to load: `path` itself if it is one, else the one its `latest` names."""
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: give a directory gradsched.save wrote (or its parent, "
                              "whose 'latest' names the newest).")
    if path.endswith(".partial") or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"the checkpoint at {path!r} is incomplete: its save did not finish (a crash or a stopped rank), so "
            "it has no metadata. Load its parent directory, whose 'latest' names the last complete checkpoint.")
    return path


def load(path: str, model, optimizer=None) -> dict:
    """Load a checkpoint saved by `save`, at any layout; every rank calls it. Returns
    {"step", "data_position", "path"}."""
    where = checkpoint_dir(path)
    md = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
    mine = _model_tensors(model, writing=False)
    _check_model(where, md, mine, model)
    if optimizer is not None and any(k.startswith("optim/") for k in md):
        saved = _read_bytes(where, md, "meta/optimizer")
        if saved != optimizer.optimizer_class.__name__:
            raise CheckpointError(f"the checkpoint at {where!r} holds the state of {saved}, but the optimizer is "
                                  f"{optimizer.optimizer_class.__name__}: load it into the same optimizer class.")
    state = {f"model/{k}": torch.empty_like(v.detach()) for k, v in mine.items()}
    state["meta/step"] = torch.zeros((), dtype=torch.int64, device="cpu")  # host metadata
    state["meta/data_position"] = torch.zeros((), dtype=torch.int64, device="cpu")
    dcp.load(state, checkpoint_id=where)
    with torch.no_grad():
        for k, v in mine.items():
            v.copy_(state[f"model/{k}"])
    if optimizer is not None:
        # a checkpoint saved before the optimizer's first step has no state: the optimizer starts
        # afresh from the loaded parameters. Otherwise its state is read for this rank's layout,
        # now if the layout is known (the first backward is compiled), else when the optimizer
        # builds its pieces at its first step
        optimizer.restore_from = (where, md) if any(k.startswith("optim/") for k in md) else None
        optimizer.optimizer = None
        sync = find_sync(model)
        if sync is not None and sync.sync_plan is not None:
            optimizer.build()
    return {"step": int(state["meta/step"]), "data_position": int(state["meta/data_position"]), "path": where}


def _read_bytes(where, md, key) -> str | None:
    if key not in md:
        return None
    t = torch.zeros(md[key].size, dtype=torch.uint8, device="cpu")
    dcp.load({key: t}, checkpoint_id=where, no_dist=True)
    return _decode(t)


def _check_model(where: str, md, mine: dict, model) -> None:
    """Refuse a checkpoint of another model, naming what differs (every rank decides alike: all read
    the same metadata and hold the same unsplit model)."""
    want = {k: tuple(v.shape) for k, v in _trained_module_names_all(model).items()}
    have = {k[len("model/"):]: tuple(m.size) for k, m in md.items() if k.startswith("model/")}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = sorted(f"{k}: saved {have[k]}, model {want[k]}" for k in set(want) & set(have) if have[k] != want[k])
    problems = []
    if missing:
        problems.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        problems.append(f"not in this model {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    if shapes:
        problems.append(f"other shapes {shapes[:8]}")
    if problems:
        raise CheckpointError(f"the checkpoint at {where!r} is not of this model: " + "; ".join(problems) +
                              ". Load a checkpoint saved from the same model configuration.")


def _trained_module_names_all(model) -> dict[str, torch.Tensor]:
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
    with _pieces_api():
        dcp.load(request, checkpoint_id=where)
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
