"""Errors that name the user's module and source line, not torch's machinery.

The pipeline split fails with export's generic "cannot capture your model" message
while the real cause, and the user's line ("from user code:"), sit in the exception
chain: read them back out.
"""
from __future__ import annotations

import difflib
import os
import re
import traceback
import weakref

import torch

from gradsched.passes.graph_utils import stack_frames

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
    frames = [(f, code) for f, code in stack_frames(message.split("from user code:", 1)[1])
              if not f.startswith('File "<')]  # generated code ('File "<eval_with_key>.3"') is not the user's
    return f"{frames[-1][0]}, code: {frames[-1][1]}" if frames else None


def user_frame(exc: BaseException) -> str | None:
    """'file:line in fn, code: ...' of the innermost frame of the user's own code in exc's chain: from
    Dynamo's and export's "from user code", else the innermost user frame that gradsched called (a loss
    function, a Python op), never the script that called gradsched."""
    for e in _chain(exc):
        found = _from_user_code(str(e))
        if found:
            return found
    for e in _chain(exc):
        frames = traceback.extract_tb(e.__traceback__)
        own = [i for i, fr in enumerate(frames) if fr.filename.startswith(_OWN_DIR)]
        for fr in reversed(frames[own[-1] + 1:] if own else frames):  # a cause's traceback starts below us
            if not fr.filename.startswith(_LIBRARY_DIRS + (_OWN_DIR, "<")) and not _compiled_file(fr.filename):
                return f"{fr.filename}:{fr.lineno} in {fr.name}, code: {fr.line}"
    return None


def _compiled_file(filename: str) -> bool:
    """Inductor's generated modules (in its cache directory, wherever TORCHINDUCTOR_CACHE_DIR puts it, as
    clusters often do) are not the user's code."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return filename.startswith(os.path.join(cache_dir(), "")) or "torchinductor" in filename


def _stage_error(what: str, cause: BaseException, where: str | None, note: str = "") -> StageError:
    text = str(cause).strip()
    return StageError(f"{what}: {type(cause).__name__}: {text.splitlines()[0] if text else ''}"
                      + (f"\n  at {where}" if where else note))


def root_cause(exc: BaseException) -> BaseException:
    return list(_chain(exc))[-1]


# ---- errors raised while a stage runs ------------------------------------------------------------
# A stage is a GraphModule (the split's, or the aten graphs compiled from it): an error in it
# points at generated code, `<eval_with_key>.N`. Each node keeps the user's stack trace in
# node.meta["stack_trace"] (export records it, Dynamo and AOTAutograd carry it on), so the
# generated line is mapped back to its node and from there to the user's line.
_GRAPHS: "weakref.WeakValueDictionary[str, torch.fx.GraphModule]" = weakref.WeakValueDictionary()
_GENERATED = re.compile(r'File "(<eval_with_key>\.\d+)", line (\d+)')


def _generated_file(gm: torch.fx.GraphModule) -> str | None:
    code = getattr(type(gm).forward, "__code__", None)
    return code.co_filename if code is not None and code.co_filename.startswith("<eval_with_key>") else None


def remember_graph(gm: torch.fx.GraphModule) -> None:
    """Make a compiled graph's errors traceable to the user's line (graphs run by the eager compiler)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    _LazyGraphModule.force_recompile(gm)  # its code now, not at its first call: the name is the code's
    name = _generated_file(gm)
    if name is not None:
        _GRAPHS[name] = gm


def _graphs_of(module: torch.nn.Module):
    for m in module.modules():  # unflatten's InterpreterModules keep their code in .graph_module
        for gm in (m, getattr(m, "graph_module", None)):
            if isinstance(gm, torch.fx.GraphModule) and _generated_file(gm):
                yield _generated_file(gm), gm


def _generated_frames(exc: BaseException) -> list[tuple[str, int]]:
    """(generated file, line) of every frame in generated code, innermost last, over exc's chain:
    from tracebacks, and from the "from user code:" text of Dynamo's errors."""
    frames = []
    for e in reversed(list(_chain(exc))):  # the chain runs outermost first
        frames += [(fr.filename, fr.lineno) for fr in traceback.extract_tb(e.__traceback__)
                   if fr.filename.startswith("<eval_with_key>")]
        frames += [(f, int(n)) for f, n in _GENERATED.findall(str(e))]
    return frames


def _node_at(graphs: dict, filename: str, lineno: int) -> torch.fx.Node | None:
    gm = graphs.get(filename)
    if gm is None or not getattr(gm, "_lineno_map", None):
        return None
    idx = gm._lineno_map.get(lineno - type(gm).forward.__code__.co_firstlineno)
    return None if idx is None else list(gm.graph.nodes)[idx]


def _map_line(graphs: dict, filename: str, lineno: int, depth: int = 0) -> str | None:
    """The user's line behind a line of generated code. A node's stack trace may itself end in
    generated code (Dynamo traced the split's GraphModule): follow it there."""
    node = _node_at(graphs, filename, lineno)
    frames = stack_frames(node.meta.get("stack_trace") or "") if node is not None else []
    library = tuple(f'File "{d}' for d in _LIBRARY_DIRS)
    for frame, code in reversed(frames):  # innermost first; torch's own modules are not the user's line
        inner = _GENERATED.search(frame)
        if inner is None and not frame.startswith(library):
            return f"{frame}, code: {code}"
        if inner is not None and depth < 8:
            found = _map_line(graphs, inner.group(1), int(inner.group(2)), depth + 1)
            if found:
                return found
    return None


def node_user_line(exc: BaseException, module: torch.nn.Module | None = None) -> str | None:
    """The user's line behind the innermost generated-code frame of exc that gradsched can map."""
    graphs = dict(_GRAPHS)
    if module is not None:
        graphs.update(_graphs_of(module))
    for filename, lineno in reversed(_generated_frames(exc)):
        found = _map_line(graphs, filename, lineno)
        if found:
            return found
    return None


def name_model_line(own: BaseException, module: torch.nn.Module | None) -> BaseException:
    """gradsched's own error (a pass's refusal) that names a line of generated code (a pipeline stage's graph,
    which Dynamo traced, `File "<eval_with_key>.N", line M, in forward (its code)`): that reference replaced by
    the model's line behind it, so the message's first words already name it (peers read only those)."""
    text = own.args[0] if own.args and isinstance(own.args[0], str) else None
    found = _GENERATED.search(text or "")
    line = node_user_line(own, module) if found else None
    if not line:
        return own
    fn = re.compile(r", in \w+").match(text, found.end())  # ', in forward'
    end = fn.end() if fn else found.end()
    if text[end:end + 2] == " (":  # its code in parentheses, which may hold parentheses of their own
        depth, i = 0, end + 1
        for i in range(end + 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
        end = i + 1
    frame, _, code = line.partition(", code: ")
    own.args = (text[:found.start()] + f"{frame} ({code})" + text[end:],) + own.args[1:]
    return own


def in_stage(what: str, exc: BaseException, module: torch.nn.Module | None, compiler: str) -> StageError:
    """A StageError with the model's own error and, where it can be mapped, the user's line.

    The model's error is the root of the chain, under pipelining's "failed to run forward" and,
    with fullgraph=True, Dynamo's "Attempt to trace generator" (Dynamo traces the GraphModule's
    own error handler, cannot trace its generator, and raises that instead)."""
    note = "" if compiler == "eager" else (f"\n  (raised in {compiler}'s compiled code, which keeps no source "
                                           "line; compiler='eager' names the model's line)")
    return _stage_error(what, root_cause(exc), node_user_line(exc, module) or user_frame(exc), note)


def in_user_code(what: str, exc: BaseException) -> StageError | None:
    """A StageError naming where the user's code failed, or None if no user frame is known."""
    where = user_frame(exc)
    return None if where is None else _stage_error(what, root_cause(exc), where)


def own_error(e: BaseException) -> BaseException | None:
    """The error a gradsched compiler pass or check raised, from under Dynamo's and pipelining's wrappers."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch._dynamo.exc.BackendCompilerFailed):
            return e.inner_exception  # raised by the gradsched backend
        if type(e).__module__.startswith("gradsched"):
            return e
        e = e.__cause__ or e.__context__
    return None
