"""A model built on the meta device (shapes, no values) made real by each rank for its own stage only.

    with torch.device("meta"):
        model = MyGPT(config)
    model = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, split_points=[...], init_weights=init)
    # init(name, tensor) fills one tensor in place, e.g. torch.nn.init.normal_(tensor, std=0.02)

At 70B no rank could build the whole model first. `parallelize` keeps the model on meta; the first
`train_step` knows the device (the inputs'), splits the model under pp > 1 on meta copies of the
micro-batch, and allocates only this rank's stage there. Every tensor of it (parameters and buffers) is
then filled by `init_weights(name, tensor)`, `name` being the unsplit model's, under torch's RNG seeded from
that name and `init_seed`: the same values on every rank, under every layout and in one process
(`initialize` on a whole model), and tied copies, one name for all, equal.

Under shard="params" the stage is whole for a moment, until its first graph is compiled and sharded. Under pp > 1
the unsplit model itself stays on meta (its names, ties and shapes are what checkpoints and parameter groups read);
at pp 1 it is the stage. On meta inputs nothing is allocated (the dry run).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsched.sync.owners import mark_superseded


def on_meta(model: nn.Module) -> bool:
    """True for a model built on the meta device; a model partly there is refused (its real tensors would be
    overwritten)."""
    tensors = list(model.parameters()) + list(model.buffers())
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        n = sum(meta)
        raise ValueError(f"{n} of the model's {len(meta)} parameters and buffers are on the meta device and the rest "
                         "are not: build the whole model under `with torch.device('meta')` (gradsched then allocates "
                         "and initializes each rank's stage), or none of it.")
    return bool(meta) and all(meta)


def deferred_init(model: nn.Module, init_weights, seed: int = 0):
    """What `materialize` needs later for a model built on meta ((init_weights, first names, seed)), None for a
    model that holds values (init_weights for it refused)."""
    meta = on_meta(model)
    if init_weights is not None and not meta:
        raise ValueError("init_weights initializes a model built on the meta device (with torch.device('meta'): ...); "
                         f"{type(model).__name__}'s tensors already hold values. Build it on meta, or drop init_weights.")
    return (init_weights, first_names(model), seed) if meta else None


def check_init(init, device: torch.device) -> None:
    """Refuse, before the first step's collectives, a meta model about to run on a real device with nothing to
    initialize it (on meta inputs it stays on meta: the dry run)."""
    if init is not None and init[0] is None and device.type != "meta":
        raise ValueError("the model is on the meta device (shapes, no values) and the inputs on "
                         f"{device}: pass parallelize(..., init_weights=fn(name, tensor)), which fills each tensor in "
                         "place (name: the unsplit model's); gradsched allocates this rank's stage on the inputs' "
                         "device and calls it once per tensor, torch's RNG seeded from the name.")


def first_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name of the unsplit model -> the first name of its Parameter: a tied copy answers its
    tie's one name (one value when initialized, one entry in a checkpoint). Every buffer name -> itself."""
    first, out = {}, {name: name for name, _ in model.named_buffers(remove_duplicate=False)}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


@torch.no_grad()
def initialize(module: nn.Module, init_weights, canonical: dict[str, str], seed: int = 0) -> None:
    """Fill every tensor of `module` (named as in the unsplit model) with init_weights(name, tensor), torch's RNG
    seeded from the tensor's canonical name and `seed` (restored afterwards)."""
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    on_meta = [name for name, t in named if t.is_meta]
    if on_meta:
        raise ValueError(f"initialize() fills allocated tensors, but {on_meta[0]!r} (and {len(on_meta) - 1} more) is "
                         "still on the meta device: allocate first (module.to_empty(device=...)), or let "
                         "gradsched.parallelize(model, init_weights=...) allocate and initialize each stage.")
    devices = sorted({t.device for _, t in named if t.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=devices):
        for name, t in named:
            if name not in canonical:  # not the user's: init_weights would give it arbitrary values
                raise ValueError(f"a stage of the split holds a tensor {name!r} that the model does not name (a tensor "
                                 "made inside forward, which the split kept as a constant?); built on meta, its value "
                                 "is lost. Register it as a buffer of its module, or build the model on a real device.")
            key = canonical[name]
            torch.manual_seed(seed * 2**32 + zlib.crc32(key.encode()))
            _poison(t)
            init_weights(key, t)
            if _poisoned(t):  # allocated memory, never written: it would train silently on whatever was there
                raise ValueError(f"init_weights({key!r}, tensor) left elements of the tensor unwritten (it fills the "
                                 "tensor it is given in place, every element, buffers too: e.g. a rotary inv_freq "
                                 "computed as the module computes it).")


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _poisoned(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return t.dtype != torch.bool and bool((t == torch.iinfo(t.dtype).min).any())


def materialize(module: nn.Module, device: torch.device, init):
    """Allocate `module`'s meta tensors on `device` and initialize them; `init` is deferred_init's (None: nothing
    to do). Returns what is left to do: None, or `init` itself on a meta device (the dry run). Several stages a
    rank: `module` is their RankStages, whose `stage_modules` hold the graphs and the same tensors (a tie on the
    rank one Parameter there too): all allocated together, each tensor once, and initialized by their names."""
    if init is None or device.type == "meta":
        return init
    check_init(init, device)
    error = None
    parts = [*getattr(module, "stage_modules", ()), module]
    try:
        _allocate(parts, device)
        for part in parts:
            _retarget_factories(part, device)
        initialize(module, *init)
    except Exception as e:  # noqa: BLE001 - agreed below, then raised
        error = e
    _agree(error, device)
    return None


def _agree(error: BaseException | None, device: torch.device) -> None:
    """Every rank allocates its stage at the same point (its first step, or allocate()): a failure on one stage
    is raised on every rank, before any of them sends a thing (the others would wait for it in the schedule)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([dist.get_rank() + 1 if error is not None else 0], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is None and failed.item():
            raise ValueError(f"rank {int(failed.item()) - 1} could not allocate or initialize its part of the model "
                             "built on meta (its own error says why); no step ran.")
    if error is not None:
        raise error


def _retarget_factories(module: nn.Module, device: torch.device) -> None:
    """The split traced the model on meta, so its graphs make new tensors there and assert it (`arange(...,
    device=meta)` for positions, `_assert_tensor_metadata(device=meta)`): each such device becomes `device`. The
    graphs are the split's GraphModules and export's InterpreterModules (a `graph`, run from `graph_module`)."""
    changed = []

    def on(a):  # a leaf of a node's arguments (compared by type first: a leaf may be a tensor)
        if (isinstance(a, torch.device) and a.type == "meta") or (isinstance(a, str) and a == "meta"):
            changed.append(a)
            return device if isinstance(a, torch.device) else str(device)
        return a
    for mod in module.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed.clear()
        for node in graph.nodes:
            before = len(changed)
            args, kwargs = torch.fx.node.map_aggregate(node.args, on), torch.fx.node.map_aggregate(node.kwargs, on)
            if len(changed) > before:
                node.args, node.kwargs = args, kwargs
        if changed:
            (mod if isinstance(mod, torch.fx.GraphModule) else mod.__dict__["graph_module"]).recompile()


def _allocate(modules: list, device: torch.device) -> None:
    """Each meta tensor replaced by an empty one on `device`, once: names that shared a tensor still share one (a
    tie), in every module given. Module.to_empty would give each name its own Parameter, and the stage would train
    a tie's copies apart."""
    new = {}
    for mod in (m for module in modules for m in module.modules()):
        for table, make in ((mod._parameters, lambda t: nn.Parameter(torch.empty_like(t, device=device), t.requires_grad)),
                            (mod._buffers, lambda t: torch.empty_like(t, device=device))):
            for key, t in list(table.items()):
                if t is not None and t.is_meta:
                    if id(t) not in new:
                        new[id(t)] = make(t)
                        if isinstance(t, nn.Parameter):
                            mark_superseded([t], f"a {device} tensor allocated for the meta one")
                    table[key] = new[id(t)]
