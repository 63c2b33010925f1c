"""Errors that name the user's module and source line, not torch's machinery.

The pipeline split fails with export's generic "cannot capture your model" message
while the real cause, and the user's line ("from user code:"), sit in the exception
chain: read them back out.
"""
from __future__ import annotations

import difflib
import os
import traceback

import torch

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, os, traceback))
_OWN_DIR = os.path.dirname(__file__) + os.sep


class StageError(RuntimeError):
    """An error raised by the model's own code inside a pipeline stage or its split."""


def check_split_points(model: torch.nn.Module, split_points) -> None:
    """Every split point must name a submodule; say which do not, and what is close."""
    names = [n for n, _ in model.named_modules() if n]
    bad = [p for p in split_points if p not in set(names)]
    if not bad:
        return
    hints = "; ".join(f"{p!r}: did you mean {difflib.get_close_matches(p, names, n=3) or 'none close'}"
                      for p in bad)
    raise ValueError(f"split_points {bad} name no submodule of {type(model).__name__} ({hints}). A split point "
                     f"is a module name that begins a stage, e.g. one of {names[:12]}"
                     f"{' ...' if len(names) > 12 else ''}.")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _from_user_code(message: str) -> str | None:
    """Dynamo and export trace bytecode, so the user's frames are in their message, not the traceback."""
    if "from user code:" not in message:
        return None
    lines = message.split("from user code:", 1)[1].strip().splitlines()
    files = [i for i, line in enumerate(lines) if line.strip().startswith('File "')]
    if not files:
        return None
    i = files[-1]
    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return f"{lines[i].strip()}, code: {code}"


def user_frame(exc: BaseException) -> str | None:
    """'file:line in fn, code: ...' of the innermost frame of the user's own code in exc's chain."""
    for e in _chain(exc):
        found = _from_user_code(str(e))
        if found:
            return found
    for e in _chain(exc):
        for fr in reversed(traceback.extract_tb(e.__traceback__)):
            if not fr.filename.startswith(_LIBRARY_DIRS + (_OWN_DIR, "<")):
                return f"{fr.filename}:{fr.lineno} in {fr.name}, code: {fr.line}"
    return None


def root_cause(exc: BaseException) -> BaseException:
    return list(_chain(exc))[-1]


def in_user_code(what: str, exc: BaseException) -> StageError | None:
    """A StageError naming where the user's code failed, or None if no user frame is known."""
    where = user_frame(exc)
    if where is None:
        return None
    cause = root_cause(exc)
    return StageError(f"{what}: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause) else ''}\n"
                      f"  at {where}")
