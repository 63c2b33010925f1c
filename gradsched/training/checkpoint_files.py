"""The files of a checkpoint: which directory holds one, and whether its bytes are those saved.

A complete checkpoint is a directory `step-<N>` holding DCP's files (`.metadata` and the ranks'
`*.distcp`) and `gradsched.manifest`, written last: the byte size and crc32 of every other file.
Its first line is the crc32 of the rest, so a damaged manifest is told apart from damaged data.
A save in progress (or one that crashed) is `step-<N>.partial`; the parent's `latest` names the
newest complete checkpoint.

Everything here reads the filesystem only: every rank that sees the same files decides alike,
with no collective.
"""
from __future__ import annotations

import json
import os
import re
import zlib

LATEST = "latest"
MANIFEST = "gradsched.manifest"
PARTIAL = ".partial"
_HEADER = "gradsched checkpoint manifest; crc32 of the lines below: "
_CHUNK = 16 << 20  # crc32 runs at about 6 GB/s here: the read dominates, in large sequential chunks
_STEP = re.compile(r"step-\d+$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model and optimizer."""


# ---- sums -------------------------------------------------------------------------------------

def file_sum(path: str) -> tuple[int, int]:
    """(size in bytes, crc32) of a file, read once."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def damage(directory: str, name: str, saved: tuple[int, int]) -> str | None:
    """What is wrong with one file of a checkpoint against its (size, crc32) when saved; None if nothing."""
    try:
        size, crc = file_sum(os.path.join(directory, name))
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    if size != saved[0]:
        how = "truncated" if size < saved[0] else "grown"
        return f"{name} is {size} bytes, {saved[0]} when saved ({how})"
    if crc != saved[1]:
        return f"{name} has other bytes than were saved (crc32 {crc:08x}, saved {saved[1]:08x})"
    return None


# ---- the manifest -----------------------------------------------------------------------------

def write_manifest(directory: str, sums: dict[str, tuple[int, int]]) -> None:
    """Write the manifest of `sums` {file name: (size, crc32)} atomically: a crash leaves none or all of it."""
    body = json.dumps({"format": 1, "files": {n: {"bytes": s, "crc32": c} for n, (s, c) in sorted(sums.items())}},
                      indent=1) + "\n"
    text = f"{_HEADER}{zlib.crc32(body.encode()):08x}\n{body}"
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> dict[str, tuple[int, int]]:
    """{file name: (size, crc32)} as saved; a manifest that is unreadable or not byte for byte as
    written (its own crc32) is a CheckpointError naming it."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise damaged(directory, [f"{MANIFEST} cannot be read ({e.strerror or e})"]) from None
    head, _, body = raw.partition(b"\n")
    if head != f"{_HEADER}{zlib.crc32(body):08x}".encode():
        raise damaged(directory, [f"{MANIFEST} (the file sizes and checksums) is not as written"])
    try:
        files = json.loads(body)["files"]
        return {n: (int(v["bytes"]), int(v["crc32"])) for n, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):  # a well-summed file of another format
        raise damaged(directory, [f"{MANIFEST} is not in a format this gradsched reads"]) from None


def damaged(directory: str, problems: list[str]) -> CheckpointError:
    """The error for a checkpoint whose files are not those saved (problems: one phrase per file)."""
    return CheckpointError(
        f"the checkpoint at {directory!r} is damaged, and nothing was loaded: {'; '.join(problems)}. Load an "
        "earlier checkpoint (another step-N beside it), or restore these files from a copy.")


# ---- which directory ----------------------------------------------------------------------------

def checkpoint_dir(path: str, verify: bool = True) -> str:
    """The checkpoint to load: `path` itself if it is one, else the one its `latest` names. Every other
    state (nothing there, an empty or foreign directory, a partial save, no `latest`, a `latest`
    naming nothing, a checkpoint without a manifest when verify) is a CheckpointError of its own."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path!r}: there is nothing at that path. Give a directory "
                              "gradsched.save wrote (or its parent, whose 'latest' names the newest).")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is a file, not a checkpoint: give the directory gradsched.save wrote "
                              "(or its parent, whose 'latest' names the newest).")
    if os.path.isfile(os.path.join(path, LATEST)):
        return _checked(_named_by_latest(path), verify)
    return _checked(path, verify) if _is_checkpoint(path) else _refuse_parent(path)


def _is_checkpoint(path: str) -> bool:
    """A checkpoint's own directory (complete or not), as opposed to a parent of checkpoints."""
    return path.rstrip(os.sep).endswith(PARTIAL) or any(
        os.path.exists(os.path.join(path, n)) for n in (MANIFEST, ".metadata"))


def _named_by_latest(parent: str) -> str:
    latest = os.path.join(parent, LATEST)
    with open(latest, "rb") as f:
        name = f.read().decode(errors="replace").strip()
    where = os.path.join(parent, name)
    if not name or not _STEP.match(name) or not os.path.isdir(where):
        raise CheckpointError(
            f"{latest!r} names {name!r}, which is not a checkpoint there (deleted, moved, or 'latest' damaged). "
            f"{_listing(parent)}")
    return where


def _checked(where: str, verify: bool) -> str:
    if where.rstrip(os.sep).endswith(PARTIAL):
        parent = os.path.dirname(where.rstrip(os.sep))
        raise CheckpointError(
            f"{where!r} is a partial save: its save did not finish (a crash or a stopped rank). Load "
            f"{parent!r}, whose 'latest' names the last complete checkpoint.")
    if os.path.isfile(os.path.join(where, MANIFEST)):
        return where
    if not os.path.isfile(os.path.join(where, ".metadata")):
        raise CheckpointError(f"the checkpoint at {where!r} has neither its manifest nor DCP's .metadata: files "
                              "were removed from it. Load an earlier checkpoint beside it.")
    if verify:
        raise CheckpointError(
            f"the checkpoint at {where!r} has no {MANIFEST} (the sizes and checksums of its files): it was "
            "written by a gradsched before checksums, or by another tool, so its bytes cannot be verified. "
            "gradsched.load(..., verify=False) loads it unverified.")
    return where


def _refuse_parent(path: str) -> str:
    """A directory that is no checkpoint and has no `latest`: say which of the other states it is."""
    names = sorted(os.listdir(path))
    steps = [n for n in names if _STEP.match(n) and os.path.isdir(os.path.join(path, n))]
    partial = [n for n in names if _STEP.match(n.removesuffix(PARTIAL)) and n.endswith(PARTIAL)]
    if steps:
        raise CheckpointError(
            f"{path!r} holds checkpoints ({', '.join(steps[-3:])}) but no 'latest' naming the newest (it was "
            f"removed, or a save of another tool wrote here): give one of them, e.g. "
            f"{os.path.join(path, steps[-1])!r}.")
    if partial:
        raise CheckpointError(
            f"{path!r} holds no complete checkpoint, only partial saves ({', '.join(partial[-3:])}) that did not "
            "finish (a crash or a stopped rank before the first save completed): start without resuming.")
    if not names:
        raise CheckpointError(f"{path!r} is empty: no checkpoint was saved there yet. Start without resuming, "
                              "or give the directory a run saved to.")
    raise CheckpointError(
        f"{path!r} is not a gradsched checkpoint: it has no 'latest', no step-N checkpoint, no {MANIFEST} and "
        f"no .metadata; it holds {names[:5]}{' ...' if len(names) > 5 else ''}. Give the directory "
        "gradsched.save wrote.")


def _listing(parent: str) -> str:
    steps = sorted(n for n in os.listdir(parent) if _STEP.match(n) and os.path.isdir(os.path.join(parent, n)))
    if not steps:
        return "It holds no complete checkpoint."
    return f"Give one of those it holds: {', '.join(steps[-3:])} (e.g. {os.path.join(parent, steps[-1])!r})."
