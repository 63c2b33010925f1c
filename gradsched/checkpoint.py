"""Checkpoints that do not depend on the layout, through torch.distributed.checkpoint (DCP).

    gradsched.save("ckpt", model, optimizer, step=step, data_position=batches_seen)
    meta = gradsched.load("ckpt", model, optimizer)   # before or after the first step
    meta["step"], meta["data_position"], meta["path"]   # path: the step-<N> directory read

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

Atomic: a save is written to <path>/step-<N>.partial; after every rank has written, the
size and crc32 of every file go into its manifest (gradsched.checkpoint_files), written
last; only then is it renamed to <path>/step-<N> and named in <path>/latest (rewritten by
a rename). A crash mid-save leaves the last good checkpoint where `latest` says.

Loading checks before reading anything: every file's size and crc32 against the manifest
(the ranks share the reading; every rank raises the same error), every record inside its
file, and the checkpoint against the model (missing, extra or reshaped parameters and
another optimizer class are refused by name). So the optimizer's state, read when the
optimizer builds its shards (its first step: only then is the layout known), has been
verified at load; the model's parameters are read at once. No error of DCP's leaves as
torch's CheckpointException (a BaseException): each is a CheckpointError.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from .checkpoint_files import (LATEST, MANIFEST, CheckpointError, checkpoint_dir, damage, damaged, file_sum,
                               read_manifest, write_manifest)
from .optimizer import unsplit_module, unsplit_named_parameters
from .runtime import find_sync
from .shards import owned_pieces
from .stage_setup import process_group

__all__ = ["CheckpointError", "checkpoint_dir", "load", "save"]


@contextlib.contextmanager
def _pieces_api():
    """DCP declares uneven pieces of a tensor through ShardedTensor, which torch deprecates in favour
    of DTensor; DTensor's shards sit at fixed, even positions, which bucket pieces do not. Its
    FutureWarning says nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _dcp(doing: str, where: str, fn):
    """fn() (a DCP call), with DCP's failures as a CheckpointError naming `where`: DCP raises
    CheckpointException, a BaseException that `except Exception` misses, on every rank alike."""
    try:
        return fn()
    except CheckpointException as e:
        why = "; ".join(f"rank {r}: {type(exc).__name__}: {_first_line(exc)}"
                        for r, (exc, _) in sorted(e.failures.items()))
        raise CheckpointError(f"{doing} the checkpoint at {where!r} failed: {why}.") from None
    except Exception as e:  # before DCP's collectives (reading .metadata, planning): this rank's own error
        raise CheckpointError(f"{doing} the checkpoint at {where!r} failed: {type(e).__name__}: "
                              f"{_first_line(e)}.") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


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
    checkpoint's directory. Atomic: until every rank has written and the manifest (each file's size
    and crc32) is in place, `latest` names the previous one."""
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
    writer = _RecordingWriter(partial)
    with _pieces_api():
        state.update(_optimizer_entries(model, optimizer))
        _dcp("saving", partial, lambda: dcp.save(state, storage_writer=writer))
    sums = _gather_sums(partial, writer.files)  # also the barrier: every rank has written
    if rank == 0:
        write_manifest(partial, _with_rank0_files(partial, sums))
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


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote: each rank sums its own files,
    while they are still in its page cache, and no rank reads another's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.files: list[str] = []

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self.files = sorted({r.storage_data.relative_path for r in fut.wait()})
        return fut


def _gather_sums(partial: str, files: list[str]) -> dict[str, tuple[int, int]]:
    """Every rank's {file: (size, crc32)}, on every rank; a rank that cannot read its files makes the
    save fail on every rank (the checkpoint stays partial), never a hang."""
    try:
        mine, problem = {n: file_sum(os.path.join(partial, n)) for n in files}, None
    except OSError as e:
        mine, problem = {}, f"rank {dist.get_rank()}: {e}"
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (mine, problem))
    problems = [p for _, p in got if p]
    if problems:
        raise CheckpointError(f"saving the checkpoint at {partial!r} failed: its files cannot be read back to "
                              f"sum them ({'; '.join(problems)}); it stays partial.")
    return {n: v for m, _ in got for n, v in m.items()}


def _with_rank0_files(partial: str, sums: dict) -> dict:
    """Add what no rank reported writing (DCP's .metadata, written by rank 0; a rank's empty file):
    the manifest covers every file of the checkpoint."""
    rest = [n for n in sorted(os.listdir(partial)) if n not in sums and not n.startswith(MANIFEST)]
    return {**sums, **{n: file_sum(os.path.join(partial, n)) for n in rest}}


def _encode(s: str) -> torch.Tensor:
    return torch.tensor(list(s.encode()), dtype=torch.uint8, device="cpu")  # host metadata


def _decode(t: torch.Tensor) -> str:
    return bytes(t.tolist()).decode()


# ---- load ------------------------------------------------------------------------------------

def load(path: str, model, optimizer=None, *, verify: bool = True) -> dict:
    """Load a checkpoint saved by `save`, at any layout; every rank calls it. Returns {"step",
    "data_position", "path"} (path: the checkpoint directory read, e.g. the one `latest` named).

    Before anything is restored, every file's size and crc32 are checked against the manifest, and
    the checkpoint against the model and optimizer: a damaged or unfitting checkpoint is a
    CheckpointError on every rank, with the model and optimizer untouched. verify=False skips the
    checksums (a checkpoint written before them: no manifest); the other checks stay."""
    where = checkpoint_dir(path, verify)
    if verify:
        _verify_files(where)
    metadata = _read_metadata(where)
    _check_records(where, metadata)
    md = metadata.state_dict_metadata
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
    _dcp("loading", where, lambda: dcp.load(state, checkpoint_id=where))
    with torch.no_grad():
        for k, v in mine.items():
            v.copy_(state[f"model/{k}"])
    if optimizer is not None:
        # a checkpoint saved before the optimizer's first step has no state: the optimizer starts
        # afresh from the loaded parameters. Otherwise its state is read for this rank's layout,
        # now if the layout is known (the first backward is compiled), else when the optimizer
        # builds its pieces at its first step (its files were verified above)
        optimizer.restore_from = (where, md) if any(k.startswith("optim/") for k in md) else None
        optimizer.optimizer = None
        sync = find_sync(model)
        if sync is not None and sync.sync_plan is not None:
            optimizer.build()
    return {"step": int(state["meta/step"]), "data_position": int(state["meta/data_position"]), "path": where}


def _verify_files(where: str) -> None:
    """Every file the manifest lists has the size and crc32 it was saved with. The ranks share the
    reading (file i is read by rank i mod world) and then every rank knows every problem, so all
    raise the same CheckpointError. Collective when a process group runs: every rank calls load."""
    sums = read_manifest(where)  # small; every rank reads it and fails alike if it is damaged
    names = sorted(sums)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = [p for n in names[rank::world] for p in [damage(where, n, sums[n])] if p]
    if world > 1:
        got = [None] * world
        dist.all_gather_object(got, problems)
        problems = [p for g in got for p in g]
    if problems:
        raise damaged(where, sorted(problems))


def _read_metadata(where: str):
    """DCP's metadata of the checkpoint (which records lie where)."""
    return _dcp("reading .metadata of", where, lambda: dcp.FileSystemReader(where).read_metadata())


def _check_records(where: str, metadata) -> None:
    """Every record .metadata places lies inside its file: truncation is found now, not when a record
    is read (the optimizer's, at the first step). Sizes only: cheap, and needs no manifest."""
    ends: dict[str, tuple[int, str]] = {}
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > ends.get(info.relative_path, (-1, ""))[0]:
            ends[info.relative_path] = (end, index.fqn)
    problems = []
    for name, (end, fqn) in sorted(ends.items()):
        try:
            size = os.path.getsize(os.path.join(where, name))
        except OSError as e:
            problems.append(f"{name} cannot be read ({e.strerror or e})")
            continue
        if size < end:
            problems.append(f"{name} is {size} bytes, but its record {fqn} ends at byte {end} (truncated)")
    if problems:
        raise damaged(where, problems)


def _read_bytes(where, md, key) -> str | None:
    if key not in md:
        return None
    t = torch.zeros(md[key].size, dtype=torch.uint8, device="cpu")
    _dcp("loading", where, lambda: dcp.load({key: t}, checkpoint_id=where, no_dist=True))
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
        _dcp("loading the optimizer's state from", where, lambda: dcp.load(request, checkpoint_id=where))
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
