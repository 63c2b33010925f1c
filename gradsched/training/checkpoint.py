"""Checkpoints that do not depend on the layout, through torch.distributed.checkpoint (DCP).

    gradsched.save("ckpt", model, optimizer, step=step, data_position=batches_seen)
    meta = gradsched.load("ckpt", model, optimizer)   # before or after the first step
    meta["step"], meta["data_position"], meta["path"]   # path: the step-<N> directory read

What is saved, by the parameter's name in the unsplit model (a tied weight under its first
name, written by the first stage of its tie):
  model/<name>             parameters and buffers, whole; a tensor several ranks hold (the
                           ranks of one stage) is written once
  optim/<name>/master      the master weights (fp32; a float64 model's float64), in the parameter's shape
  optim/<name>/<state>     the optimizer's state of that parameter (exp_avg, exp_avg_sq, ...), in
                           its shape; scalar state (step) whole
  meta/step, meta/data_position, meta/optimizer (the optimizer class's name, as bytes)
Each rank writes only the pieces of the parameters its shards hold (gradsched.training.shards; under
tp > 1 of its TP shards), declared to DCP as blocks of the whole parameter
(gradsched.training.checkpoint_chunks): nothing is gathered, and loading reads, for each block of the
new layout, whatever saved blocks overlap it. So a run saved at tp2 x pp2 x dp2 loads at pp1 x dp4,
at tp4 or with another bucket_mb.

Atomic: a save is written to <path>/step-<N>.partial; after every rank has written, the
size and crc32 of every file go into its manifest (gradsched.training.checkpoint_files), written
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
import functools
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from gradsched.training.model_state import find_sync
from gradsched.sync.watchdog import JOURNAL, CollectiveFault
from gradsched.training.checkpoint_files import (LATEST, MANIFEST, CheckpointError, checkpoint_dir, damage, damaged,
                                                 file_sum, read_manifest, write_manifest)
from gradsched.training.checkpoint_state import (dcp_call, model_tensors, optimizer_entries, pieces_api, restore_into,
                                                 sharded_parameter_names, tp_model_entries, tp_model_reads,
                                                 tp_shards_by_key, trained_module_names_all)

__all__ = ["CheckpointError", "checkpoint_dir", "load", "save"]


# ---- save ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _peers_named(doing: str, path: str):
    """A peer that dies while this rank saves or loads: a CheckpointError naming it (gradsched.sync.watchdog)."""
    try:
        with JOURNAL.entry(f"{doing} the checkpoint at {path!r}", "io"):
            yield
    except CollectiveFault as e:
        raise CheckpointError(f"{doing} the checkpoint at {path!r} failed: {e}") from e


def save(path: str, model, optimizer=None, *, step: int, data_position: int | None = None) -> str:
    """Save the model, the optimizer and the position of the run; every rank calls it. Returns the
    checkpoint's directory. Atomic: until every rank has written and the manifest (each file's size
    and crc32) is in place, `latest` names the previous one."""
    with _peers_named("saving", path):
        return _save(path, model, optimizer, step=step, data_position=data_position)


def _save(path: str, model, optimizer=None, *, step: int, data_position: int | None = None) -> str:
    """The body of save: the same arguments."""
    rank = dist.get_rank()
    final = os.path.join(path, f"step-{step:08d}")
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a crashed save of this step
    dist.barrier()
    tensors = model_tensors(model, writing=True)
    state = {f"model/{k}": v.detach() for k, v in tensors.items()}
    state["meta/step"] = torch.tensor(step, dtype=torch.int64, device="cpu")
    state["meta/data_position"] = torch.tensor(step if data_position is None else data_position, dtype=torch.int64,
                                                 device="cpu")
    if optimizer is not None:
        state["meta/optimizer"] = _encode(optimizer.optimizer_class.__name__)
    writer = _RecordingWriter(partial)
    with pieces_api():
        state.update(tp_model_entries(model, tensors))  # a TP shard: its chunks of the whole
        state.update(optimizer_entries(model, optimizer))
        dcp_call("saving", partial, lambda: dcp.save(state, storage_writer=writer))
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
    with _peers_named("loading", path):
        return _load(path, model, optimizer, verify=verify)


def _load(path: str, model, optimizer=None, *, verify: bool = True) -> dict:
    """The body of load: the same arguments."""
    where = checkpoint_dir(path, verify)
    if verify:
        _verify_files(where)
    metadata = _read_metadata(where)
    _check_records(where, metadata)
    md = metadata.state_dict_metadata
    mine = model_tensors(model, writing=False)
    _check_model(where, md, mine, model)
    if optimizer is not None and any(k.startswith("optim/") for k in md):
        saved = _read_bytes(where, md, "meta/optimizer")
        if saved != optimizer.optimizer_class.__name__:
            raise CheckpointError(f"the checkpoint at {where!r} holds the state of {saved}, but the optimizer is "
                                  f"{optimizer.optimizer_class.__name__}: load it into the same optimizer class.")
    with pieces_api():
        tp_request, tp_reads, tp_values = tp_model_reads(model, mine)  # a TP shard: its chunks of the whole
    state = {f"model/{k}": torch.empty_like(v.detach()) for k, v in mine.items() if f"model/{k}" not in tp_request}
    state.update(tp_request)
    state["meta/step"] = torch.zeros((), dtype=torch.int64, device="cpu")  # host metadata
    state["meta/data_position"] = torch.zeros((), dtype=torch.int64, device="cpu")
    with pieces_api():
        dcp_call("loading", where, lambda: dcp.load(state, checkpoint_id=where))
    tp_reads.put()
    shards = tp_shards_by_key(model)
    sharded = sharded_parameter_names(model)  # shard="params": their own storage is released
    with torch.no_grad():
        for k, v in mine.items():
            v, value = (shards[k], tp_values[k].view(shards[k].shape)) if k in shards else (v, state[f"model/{k}"])
            if id(v) in sharded:
                find_sync(model).param_shards.set_whole(sharded[id(v)], value)
            else:
                v.copy_(value)
    if optimizer is not None:
        # a checkpoint saved before the optimizer's first step has no state: the optimizer starts
        # afresh from the loaded parameters. Otherwise its state is read for this rank's layout,
        # now if the layout is known (the first backward is compiled), else when the optimizer
        # builds its pieces at its first step (its files were verified above)
        optimizer.restore_from = (functools.partial(restore_into, where=where, md=md)
                                  if any(k.startswith("optim/") for k in md) else None)
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
    return dcp_call("reading .metadata of", where, lambda: dcp.FileSystemReader(where).read_metadata())


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
    dcp_call("loading", where, lambda: dcp.load({key: t}, checkpoint_id=where, no_dist=True))
    return _decode(t)


def _check_model(where: str, md, mine: dict, model) -> None:
    """Refuse a checkpoint of another model, naming what differs (every rank decides alike: all read
    the same metadata and hold the same unsplit model)."""
    want = {k: tuple(v.shape) for k, v in trained_module_names_all(model).items()}
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


