"""What torch.distributed.pipelining's split loses, checked or put back, for parallelize.

The split (torch.export) orders a stage's inputs by first use and runs checkpointed calls as
plain calls. check_first_stage_inputs refuses a model whose inputs the split would reorder (each
would land in another's place); pass_through_skips passes a value a stage reads from two or more
stages back through the stages between (pipelining sends to the next stage only), and
check_adjacent_stages refuses what is left; checkpointed_calls records which calls the model checkpoints
while it is traced, hf_checkpointed_layers finds Hugging Face layers that checkpoint themselves,
and checkpoint_stage_modules checkpoints the same submodules of a stage again. release_stale_copies frees a
tied weight's copy the split leaves on a stage that never reads it; release_other_stages
drops what the user's model still holds of the other stages once this rank's stage is built;
train_the_users_tied_parameters makes a tie's copy on this rank the user's own Parameter;
release_unread_tied_copies frees the copies a rank's stages hold of a tie and never read (several a rank).
"""
from __future__ import annotations

import contextlib
import functools
import operator

import torch
import torch.nn as nn

from gradsched.sync.ties import used_parameters
from gradsched.user_errors import StageError
from gradsched.training.virtual_stages import set_parameter


def check_stage_count(pipe, split_points, model_name: str) -> None:
    """Each split point begins a stage of its own; one that begins none is refused before anything runs
    (pipelining's own errors name no split point: a missing submodule, an invalid stage index)."""
    want = len(split_points) + 1
    if pipe.num_stages != want:
        raise StageError(
            f"splitting {model_name} at {list(split_points)} made {pipe.num_stages} stages, not {want}: a split "
            "point begins no stage of its own when it is the model's first module (stage 0 would hold nothing), a "
            "container whose own forward is never called (a ModuleList: name its items, e.g. 'blocks.1'), or a "
            "module the forward does not run. Name modules the forward calls, after the first.")


def check_first_stage_inputs(pipe, model_name: str) -> None:
    """The split orders the first stage's inputs by first use in forward, and the schedule hands
    them over in the model's call order: if they differ, every input would land in another's place
    (tokens read as positions: silently wrong). Refuse instead."""
    def inputs(gm):
        return [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    called, first = inputs(pipe.split_gm), inputs(pipe.get_stage_module(0))
    if first != called[:len(first)]:
        raise StageError(f"splitting {model_name} into pipeline stages: its first stage takes its inputs in "
                         f"the order {first}, and the model is called with {called}: the pipeline would pass "
                         "each in another's place. Make the model's forward use its inputs first in the order "
                         "it takes them (e.g. touch them in that order at the top of forward).")


def pass_through_skips(pipe) -> int:
    """Pipelining hands a stage the previous stage's outputs only. A value a stage reads from further back (a
    Hugging Face decoder's rotary embeddings, computed once in the first stage for every layer) is passed through
    each stage in between, in place: each takes it as one more input and returns it as one more output (one
    more tensor sent, nothing computed). Returns how many (value, stage) passes it added.

    Invariant established: every stage after the first reads, among other stages' values, only the outputs of the
    stage just before it (check_adjacent_stages holds), and the split computes what it computed before. Assumes the
    reads are positional arguments of the stages' calls (one read through a keyword or a nested structure is left
    for check_adjacent_stages to refuse)."""
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    stage_of = {n: int(str(n.target).rsplit("_", 1)[1]) for n in calls}
    passed: dict = {}  # ((the stage computing the value, its output index), stage) -> the node passing it on
    for node in calls:
        i = stage_of[node]
        for k in range(len(node.args)):
            a = node.args[k]  # read each time: passing a value on may have made a stage's one output a tuple's first
            src, at = (a.args[0], a.args[1]) if a.op == "call_function" and a.target is operator.getitem else (a, 0)
            j = stage_of.get(src)
            if j is None or j >= i - 1:
                continue
            meta = dict(_outputs(gm.get_submodule(src.target))[at].meta)
            value = (src, at)
            for t in range(j + 1, i):
                if (value, t) not in passed:
                    passed[(value, t)] = _pass_on(gm, calls[t], passed.get((value, t - 1), a), meta)
            node.args = (*node.args[:k], passed[(value, i - 1)], *node.args[k + 1:])
    gm.graph.lint()
    gm.recompile()
    return len(passed)


def _outputs(module) -> list:
    res = module.graph.output_node().args[0]
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _pass_on(gm, call, value, meta: dict):
    """Stage `call` takes `value` as its last input and returns it as its last output; returns the split graph's
    node for that output."""
    module = gm.get_submodule(call.target)
    g = module.graph
    placeholders = list(g.find_nodes(op="placeholder"))
    if value in call.args:  # the stage reads it already: its input is returned as it is
        p = placeholders[call.args.index(value)]
    else:
        with g.inserting_after(placeholders[-1]):
            p = g.placeholder(f"passed_{value.name}")
        p.meta.update(meta)
        call.args = (*call.args, value)
    out = g.output_node()
    single = not isinstance(out.args[0], (tuple, list))
    outs = _outputs(module) + [p]
    out.args = (tuple(outs),)
    module.recompile()
    anchor = call
    if single:  # its one output was the call itself: now the first of a tuple
        with gm.graph.inserting_after(call):
            anchor = gm.graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(anchor, delete_user_cb=lambda u: u is not anchor)
    with gm.graph.inserting_after(anchor):
        return gm.graph.call_function(operator.getitem, (call, len(outs) - 1))


def check_adjacent_stages(pipe, model_name: str) -> None:
    """Pipelining hands each stage the previous stage's outputs and nothing else: a stage that reads a value an
    earlier stage computed, past the one before it, would wait for a send that never comes (the run stops there,
    or fails in the stage's call). Refuse at the split, on every rank alike, naming the stages."""
    stage_of = {n: int(str(n.target).rsplit("_", 1)[1]) for n in pipe.split_gm.graph.nodes if n.op == "call_module"}
    for node, i in stage_of.items():
        for a in node.all_input_nodes:
            src = a
            while src.op == "call_function" and src.target is operator.getitem:
                src = src.args[0]
            j = stage_of.get(src)
            if j is not None and j != i - 1:
                raise StageError(
                    f"splitting {model_name} into {len(stage_of)} pipeline stages: stage {i} reads a value stage "
                    f"{j} computes ({a.name}), but pipelining passes a stage the outputs of the stage before it "
                    f"only, so stage {i} would wait for it forever (gradsched passes a positional tensor on through "
                    "the stages between, not one inside a keyword argument or a nested structure). Choose split "
                    "points that no such value crosses twice, or fewer stages.")


@contextlib.contextmanager
def checkpointed_calls():
    """(function, checkpoint arguments) for each call torch.utils.checkpoint is asked to checkpoint
    while this runs, either use_reentrant."""
    import torch.utils.checkpoint as ckpt
    calls, reentrant, generator = [], ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator

    class Reentrant:
        @staticmethod
        def apply(function, *args):
            calls.append((function, {"use_reentrant": True}))
            return reentrant.apply(function, *args)

    def non_reentrant(function, preserve_rng_state=True, context_fn=ckpt.noop_context_fn, *args, **kwargs):
        selective = {} if context_fn is ckpt.noop_context_fn else {"context_fn": context_fn}  # Dynamo takes no other
        calls.append((function, {"use_reentrant": False, **selective}))
        return generator(function, preserve_rng_state, context_fn, *args, **kwargs)

    ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = Reentrant, non_reentrant
    try:
        yield calls
    finally:
        ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = reentrant, generator


def hf_checkpointed_layers(model: nn.Module) -> list:
    """(layer, checkpoint arguments) for each Hugging Face layer that checkpoints itself (a
    GradientCheckpointingLayer whose flag gradient_checkpointing_enable / activation_checkpointing_enable
    set). transformers >= 5.24 checkpoints only in grad mode, so the trace, run under no_grad, sees no call."""
    import torch.utils.checkpoint as ckpt
    found = []
    for m in model.modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) is True and isinstance(func, functools.partial) and \
                "GradientCheckpointingLayer" in {c.__name__ for c in type(m).__mro__}:
            kw = {k: v for k, v in func.keywords.items() if k in ("use_reentrant", "context_fn")}
            if kw.get("context_fn") is ckpt.noop_context_fn:
                del kw["context_fn"]
            found.append((m, kw))
    return found


def _module_called(function) -> nn.Module | None:
    """The module whose forward a checkpointed function is: the module itself (checkpoint(block, x)), the
    owner of a bound method, or, through partials, a class's forward given its module first (HF's layers
    checkpoint partial(forward, self, **kwargs))."""
    while isinstance(function, functools.partial):
        first = function.args[0] if function.args else None
        if isinstance(first, nn.Module) and _is_forward_of(function.func, first):
            return first
        function = function.func
    owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _is_forward_of(function, module: nn.Module) -> bool:
    qualname = getattr(function, "__qualname__", "").split(".")
    return qualname[-1:] == ["forward"] and len(qualname) > 1 and \
        qualname[-2] in {c.__name__ for c in type(module).__mro__}


def checkpoint_stage_modules(stage_module: nn.Module, model: nn.Module, calls: list) -> list:
    """Activation checkpointing back in a pipeline stage: pipelining's trace (torch.export) runs each
    checkpointed call as a plain one, so the stage it builds holds no checkpoint. Every submodule of
    `stage_module` named as a module the model checkpointed gets its calls checkpointed again, with
    the same arguments (Dynamo then makes them tag_activation_checkpoint, as in the unsplit model;
    parameter names are unchanged). Returns the checkpointed functions that are no module's call,
    which cannot be put back."""
    names = {id(m): n for n, m in model.named_modules()}
    lost, wanted = [], {}
    for function, kwargs in calls:
        module = _module_called(function)
        if module is None or id(module) not in names:
            lost.append(function)
        else:
            wanted[names[id(module)]] = kwargs
    for name, sub in stage_module.named_modules():
        if name in wanted:
            _checkpoint_calls(sub, wanted[name])
    return lost


def _checkpoint_calls(module: nn.Module, kwargs: dict) -> None:
    from torch.utils.checkpoint import checkpoint
    cls = type(module)

    def forward(self, *args, **kw):
        return checkpoint(super(checkpointed, self).forward, *args, **kwargs, **kw)
    checkpointed = type(cls.__name__, (cls,), {"forward": forward})  # its own class: the instance only
    module.__class__ = checkpointed


def warn_checkpointing_dropped(calls: int, pp: int) -> None:
    import warnings
    warnings.warn(f"activation checkpointing is partly lost under pipeline parallelism (pp={pp}): "
                  f"torch.distributed.pipelining's trace runs the model's checkpointed calls as plain calls, "
                  f"and gradsched puts back only checkpoints of a module's call; {calls} call(s) of other "
                  "functions keep their activations. Training is unchanged; memory is not saved there. "
                  "Checkpoint whole modules (torch.utils.checkpoint(module, ...)) to keep it.",
                  UserWarning, stacklevel=3)


def release_other_stages(model: nn.Module, stage_module: nn.Module) -> int:
    """Under pp > 1 the user's model still holds every stage's tensors after the split, though this rank trains
    its own stage's only: the others' are replaced by meta tensors of their shapes (as a model built on meta
    has them; a tensor shared by several modules stays one), so that a model built for real costs a rank its
    stage alone. An optimizer built over `model.parameters()` before the split still holds the originals (never
    stepped here: they get no gradient) and would keep the whole model alive on every rank: each is given an
    empty tensor in place of its values (not a freed storage under its old shape, which a read, such as LBFGS's
    update of every parameter, would take for memory). Returns the bytes released."""
    mine = {id(t) for t in (*stage_module.parameters(), *stage_module.buffers())}
    replaced, released = {}, 0
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None or id(t) in mine or t.is_meta:
                    continue
                if id(t) not in replaced:
                    released += t.untyped_storage().nbytes()
                    empty = torch.empty_like(t, device="meta")
                    replaced[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)  # a view's storage stays its own
                table[name] = replaced[id(t)]
    return released


def _release(storage) -> int:
    """Frees a storage in place (its tensors keep their shapes); 0 for one that cannot be resized (memory-mapped
    from a checkpoint file: the file keeps it, not this process's memory)."""
    nbytes = storage.nbytes()
    try:
        with torch.no_grad():
            storage.resize_(0)
    except RuntimeError:
        return 0
    return nbytes


def release_stale_copies(stage_module: nn.Module, stale: set) -> int:
    """A tied weight's copy that pipelining's split leaves on a stage that never reads it (the first stage keeps
    the head's) holds a whole vocabulary x hidden matrix for nothing: its storage is released (its shape kept;
    a read would fail, not read stale values), unless a tensor the stage trains shares it. Returns the bytes."""
    kept = {t.untyped_storage().data_ptr() for n, t in stage_module.named_parameters(remove_duplicate=False)
            if n not in stale}
    released = 0
    for n, t in stage_module.named_parameters(remove_duplicate=False):
        storage = t.untyped_storage()
        if n in stale and not t.is_meta and storage.nbytes() and storage.data_ptr() not in kept:
            released += _release(storage)
    return released


def release_unread_tied_copies(stage_modules: list, tie_names: set) -> int:
    """Several stages a rank: where a tie's copies are all read on this rank (a V: the embedding by the first
    stage, the head by the last), each stage still holds the split's copy under the other's name, which no
    stale name covers and no one reads: a vocabulary x hidden matrix each. Released, unless a tensor some stage
    of the rank reads shares its storage. Returns the bytes."""
    used = [used_parameters(m) for m in stage_modules]
    read = set()
    for m, names in zip(stage_modules, used):
        read |= {t.untyped_storage().data_ptr() for n, t in m.named_parameters(remove_duplicate=False) if n in names}
        read |= {t.untyped_storage().data_ptr() for t in m.buffers()}
    released = 0
    for m, names in zip(stage_modules, used):
        for n, t in m.named_parameters(remove_duplicate=False):
            storage = t.untyped_storage()
            if n in tie_names and n not in names and not t.is_meta and storage.nbytes() and \
                    storage.data_ptr() not in read:
                released += _release(storage)
    return released


def train_the_users_tied_parameters(model: nn.Module, modules: dict, ties: list) -> int:
    """The split gives a tied weight a new Parameter on each stage that reads it, while `model.parameters()` (what
    a plain torch optimizer is handed, often before the first step) holds the user's own: that one never got a
    gradient and the tie was never stepped. Each copy this rank's stages read (`modules`: stage -> module) is
    made the user's Parameter under its name, whose values it already has. Not on meta (allocation makes new
    Parameters there: an optimizer built before it is refused, gradsched.sync.owners), nor where the user's model
    holds another tensor under that name (a tie declared by hand between two Parameters), nor where its storage
    is released (the dry run splits once for every role of one model). Returns the copies replaced."""
    replaced = 0
    for tie in ties:
        for stage, name in tie.members:
            if stage not in modules:
                continue
            try:
                copy, own = modules[stage].get_parameter(name), model.get_parameter(name)
            except AttributeError:  # a tie declared by hand under a name that is no parameter: named at its check
                continue
            if own is copy or own.is_meta or copy.is_meta or own.shape != copy.shape or own.dtype != copy.dtype or \
                    own.untyped_storage().nbytes() < own.numel() * own.element_size():  # released (dry run roles)
                continue
            with torch.no_grad():
                own.copy_(copy)  # the same values, unless the split's copy moved or was re-initialised
            read = used_parameters(modules[stage])
            for n, p in list(modules[stage].named_parameters(remove_duplicate=False)):
                if n == name:
                    set_parameter(modules[stage], n, own)
                elif p is own and n not in read:  # the split left the user's under a name the stage never reads
                    set_parameter(modules[stage], n, copy)  # (the head's, on the first stage): the copy takes its place there
            replaced += 1
    return replaced
