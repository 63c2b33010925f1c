"""What a checkpoint holds, as DCP entries, and how this rank's tensors map onto them.

Names: a parameter under its first name in the unsplit model (canonical_names); a tied copy is
written by the first stage of its tie, and the stale copies pipelining's split leaves are never
read or written (skipped). A TP shard, and the optimizer's master weights and per-element state, are
written as blocks of the whole parameter in its shape (a ShardedTensor of the chunks _Parts finds: each
TP rank's, of one replica), so any layout reads whatever saved blocks overlap its own (restore_into,
tp_model_reads). dcp_call turns DCP's
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
from gradsched.training.checkpoint_chunks import Reads, chunks, sharded_entry, whole_shape
from gradsched.training.checkpoint_files import CheckpointError
from gradsched.training.materialize import first_names
from gradsched.training.model_state import find_sync, stale_names, state_of, trained_module, unsplit_module
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
    sync = find_sync(model)
    if sync is not None:  # shard=True: the last step's parameter all-gather lands before they are written or read into
        sync.finish_param_gather()
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
    state = state_of(model)
    if writing and state is not None and state.tp_shards is not None:  # a TP shard's values, not its whole's
        out = {k: state.trained(v) if isinstance(v, torch.nn.Parameter) else v for k, v in out.items()}
    sync = find_sync(model)
    if writing and sync is not None and sync.param_shards is not None:  # shard="params": the values, gathered
        full = sync.full_parameters()
        by_id = {id(p): full[n] for n, p in sync.params.items()}
        out = {k: by_id.get(id(v), v) for k, v in out.items()}
    return {k: v for k, v in out.items() if k in known}


def tp_shards_by_key(model) -> dict[str, torch.nn.Parameter]:
    """name in the checkpoint -> this rank's TP shard standing for that whole parameter (tp > 1)."""
    state = state_of(model)
    if state is None or state.tp_shards is None:
        return {}
    canon = canonical_names(model)
    return {canon.get(k, k): sh for k, v in trained_module(model).named_parameters(remove_duplicate=False)
            if (sh := state.tp_shards.of(v)) is not None}


def tp_model_entries(model, tensors: dict) -> dict:
    """model/<name> entries of the TP shards among `tensors` (model_tensors(writing=True)'s: their values)."""
    parts = _Parts(model)
    return {f"model/{k}": parts.write_whole(sh, tensors[k]) for k, sh in tp_shards_by_key(model).items()
            if k in tensors}


def tp_model_reads(model, keys) -> tuple[dict, Reads, dict]:
    """(model/<name> requests of this rank's TP shards, the reads that put them in place, name -> the shard's
    values once put), for the checkpoint keys `keys`."""
    parts, reads, values, request = _Parts(model), Reads(), {}, {}
    for k, sh in tp_shards_by_key(model).items():
        if k in keys:
            values[k] = torch.zeros(sh.numel(), dtype=sh.dtype, device=sh.device)
            request[f"model/{k}"] = parts.read_whole(sh, values[k], reads)
    return request, reads, values


def sharded_parameter_names(model) -> dict[int, str]:
    """id(parameter) -> name, for the parameters that live as shards (shard="params", once laid out)."""
    sync = find_sync(model)
    if sync is None or sync.param_shards is None:
        return {}
    return {id(p): n for n, p in sync.params.items()}


# ---- pieces as DCP sees them ----------------------------------------------------------------

class _Parts:
    """How this rank's parts lie in the whole tensors the checkpoint keys: each trained tensor's TP partition
    (none: whole), and the ranks whose pieces of a tensor write it (a part several ranks hold, replicas over
    dp x cp or over TP, is written by one of them: chunks must not overlap)."""

    def __init__(self, model):
        self.plan = model.plan
        state = state_of(model)
        self.shards = state.tp_shards if state is not None else None
        self.tp_rank = self.plan.index("tp")

    def partition(self, p):
        """The TP partition of a trained tensor `p` (None: whole on every TP rank)."""
        return self.shards.partition_of_shard(p) if self.shards is not None else None

    def whole(self, p) -> tuple:
        return whole_shape(tuple(p.shape), self.partition(p), self.plan.tp)

    def chunks(self, p, lo: int, hi: int, tp_rank: int | None = None) -> list:
        """The chunks of the whole tensor that elements [lo, hi) of TP rank `tp_rank`'s `p` hold (this rank's)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        return chunks(tuple(p.shape), lo, hi, self.partition(p), self.plan.tp, t)

    def global_rank(self, plan_rank: int, tp_rank: int) -> int:
        """The global rank holding at TP rank `tp_rank` what plan rank `plan_rank` (this TP index) holds."""
        return self.plan.global_rank(plan_rank - self.tp_rank + tp_rank)

    def writer_tp_ranks(self, p):
        """Every TP rank writes its shard; a tensor whole on every TP rank is written by TP rank 0's."""
        return range(self.plan.tp) if self.partition(p) is not None else range(1)

    def write_entries(self, p, pieces_by_rank: dict, local: dict, dtype, device):
        """The entry writing the whole of `p`: pieces_by_rank {plan rank (this TP index): [(lo, hi)]} of every
        writer, local {(lo, hi): this rank's flat tensor of that piece}."""
        entries, mine = [], []
        for t in self.writer_tp_ranks(p):
            for r, pieces in pieces_by_rank.items():
                for lo, hi in pieces:
                    cs = self.chunks(p, lo, hi, t)
                    entries += [(self.global_rank(r, t), c) for c in cs]
                    if t == self.tp_rank and r == self.plan.rank:
                        mine += [c.view(local[(lo, hi)]).contiguous() for c in cs]
        return sharded_entry(self.whole(p), entries, mine, dtype, device)

    def read_entries(self, p, pieces_by_rank: dict, flats: dict, reads: Reads, flat_shape: tuple | None = None):
        """The entry reading this rank's pieces of `p` into flats {(lo, hi): flat tensor}: declared over a cover
        of the whole tensor that holds them (this TP index's pieces, and under TP every TP rank's at the same
        coordinates). `flat_shape`: the tensor was saved flattened (an earlier gradsched's checkpoint)."""
        entries, mine = [], []
        for t in (range(self.plan.tp) if self.partition(p) is not None else [self.tp_rank]):
            for r, pieces in pieces_by_rank.items():
                for lo, hi in pieces:
                    cs = chunks(flat_shape, lo, hi) if flat_shape else self.chunks(p, lo, hi, t)
                    entries += [(self.global_rank(r, t), c) for c in cs]
                    if t == self.tp_rank and r == self.plan.rank:
                        mine += [(flats[(lo, hi)], c) for c in cs]
        return reads.request(flat_shape or self.whole(p), entries, mine)

    def read_whole(self, p, flat: torch.Tensor, reads: Reads, flat_shape: tuple | None = None):
        """The entry reading all of this rank's `p` into `flat`."""
        return self.read_entries(p, {self.plan.rank: [(0, flat.numel())]}, {(0, flat.numel()): flat}, reads,
                                 flat_shape)

    def write_whole(self, p, values: torch.Tensor):
        """The entry writing TP shard `p` whole from its values, by its first replica on each TP rank."""
        flat = values.detach().reshape(-1)
        return self.write_entries(p, {self.plan.first_replica(): [(0, flat.numel())]}, {(0, flat.numel()): flat},
                                  flat.dtype, flat.device)


def _pieces_by_rank(plan) -> dict[str, dict[int, list]]:
    """parameter name -> {plan rank of the gradient group: [(lo, hi)]} (this TP index's ranks)."""
    out: dict[str, dict] = {}
    for k, r in enumerate(plan.grad_group.ranks):
        for pc in owned_pieces(plan.layout, k):
            out.setdefault(pc.name, {}).setdefault(r, []).append((pc.lo, pc.hi))
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
    parts, out = _Parts(model), {}
    if not plan.shard:  # whole parameters (each TP shard whole): a plain optimizer over them
        first = parts.plan.first_replica()  # of a TP shard's dp x cp replicas, one writes
        for name, p in sync.params.items():
            if name in skip:
                continue
            key, dtype = f"optim/{canon.get(name, name)}", master_dtype(p.dtype)
            values = {"master": p.detach().to(dtype)}
            values.update({k: v for k, v in optimizer.optimizer.state.get(p, {}).items() if isinstance(v, torch.Tensor)})
            for k, v in values.items():
                if not v.dim():
                    out[f"{key}/{k}"] = v  # scalar (step)
                elif parts.partition(p) is None:
                    out[f"{key}/{k}"] = v.reshape(p.shape)  # whole: every replica writes the same (DCP keeps one)
                else:
                    pieces = {first: [(0, p.numel())]}
                    out[f"{key}/{k}"] = parts.write_entries(p, pieces, {(0, p.numel()): v.reshape(-1)}, dtype,
                                                            p.device)
        return out
    everyone = _pieces_by_rank(plan)
    by_name: dict[str, list] = {}
    for pc, master in zip(optimizer.pieces, optimizer.masters):
        by_name.setdefault(pc.name, []).append((pc, master))
    state_keys = _state_keys(optimizer, plan)
    for name in sorted(everyone):
        if name in skip:
            continue
        key, p = f"optim/{canon.get(name, name)}", sync.params[name]
        dtype, mine = master_dtype(p.dtype), by_name.get(name, [])
        out[f"{key}/master"] = parts.write_entries(p, everyone[name], {(pc.lo, pc.hi): m.detach() for pc, m in mine},
                                                   dtype, p.device)
        states = {}
        for pc, m in mine:
            for k, v in optimizer.optimizer.state.get(m, {}).items():
                if isinstance(v, torch.Tensor) and v.dim():
                    states.setdefault(k, {})[(pc.lo, pc.hi)] = v
                elif isinstance(v, torch.Tensor):
                    out[f"{key}/{k}"] = v  # scalar (step): the same on every piece
        for k in state_keys:
            out[f"{key}/{k}"] = parts.write_entries(p, everyone[name], states.get(k, {}), dtype, p.device)
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
    parts, reads, request = _Parts(optimizer.model), Reads(), {}

    def flat_shape(name, key, state):
        """None: saved as the whole parameter in its shape; else the flat shape an earlier gradsched saved it in
        (readable where the parameter is whole on this rank)."""
        saved_shape, p = tuple(md[f"optim/{key}/{state}"].size), sync.params[name]
        if saved_shape == parts.whole(p):
            return None
        if parts.partition(p) is None and saved_shape == (p.numel(),):
            return saved_shape
        raise CheckpointError(f"the checkpoint at {where!r} holds optim/{key}/{state} as {saved_shape}, which is "
                              f"neither the parameter's shape {parts.whole(p)} nor (where it is whole) flattened.")

    values = {}  # (name, state) -> this rank's flat tensor of each piece, by (lo, hi)
    if plan.shard:
        everyone = _pieces_by_rank(plan)
        mine_by_name: dict[str, list] = {}
        for pc in optimizer.pieces:
            mine_by_name.setdefault(pc.name, []).append(pc)
        for name, mine in mine_by_name.items():
            key, device = canon.get(name, name), sync.params[name].device
            for state in saved[key]:
                m = md[f"optim/{key}/{state}"]
                if len(m.size) == 0:  # scalar state: read by the ranks that step a piece of it
                    request[f"optim/{key}/{state}"] = torch.zeros((), dtype=m.properties.dtype,
                                                                  device=_scalar_device(optimizer, device))
                    continue
                flats = {(pc.lo, pc.hi): torch.zeros(pc.numel, dtype=m.properties.dtype, device=device) for pc in mine}
                values[(name, state)] = flats
                request[f"optim/{key}/{state}"] = parts.read_entries(sync.params[name], everyone[name], flats, reads,
                                                                     flat_shape(name, key, state))
    else:
        for name, p in sync.params.items():
            key = canon.get(name, name)
            for state in saved[key]:
                m = md[f"optim/{key}/{state}"]
                if len(m.size) == 0:
                    request[f"optim/{key}/{state}"] = torch.zeros((), dtype=m.properties.dtype, device=p.device)
                    continue
                flat = torch.zeros(p.numel(), dtype=m.properties.dtype, device=p.device)
                values[(name, state)] = {(0, p.numel()): flat}
                request[f"optim/{key}/{state}"] = parts.read_whole(p, flat, reads, flat_shape(name, key, state))
    with pieces_api():
        dcp_call("loading the optimizer's state from", where, lambda: dcp.load(request, checkpoint_id=where))
    reads.put()

    def got(name, state, lo, hi):
        key = canon.get(name, name)
        return values[(name, state)][(lo, hi)] if (name, state) in values else request[f"optim/{key}/{state}"]

    with torch.no_grad():
        if plan.shard:
            for pc, master in zip(optimizer.pieces, optimizer.masters):
                key = canon.get(pc.name, pc.name)
                master.copy_(got(pc.name, "master", pc.lo, pc.hi))
                optimizer.optimizer.state[master] = {s: got(pc.name, s, pc.lo, pc.hi).clone()
                                                     for s in saved[key] if s != "master"}
        else:
            for name, p in sync.params.items():
                key = canon.get(name, name)
                optimizer.optimizer.state[p] = {
                    s: (v.view(p.shape) if v.dim() else v).clone()
                    for s in saved[key] if s != "master" for v in [got(name, s, 0, p.numel())]}


def _scalar_device(optimizer, device):
    """Where torch keeps a scalar state such as Adam's step: on the parameters' device when the
    optimizer is capturable or fused, else on the host."""
    d = optimizer.optimizer.defaults
    return device if d.get("capturable") or d.get("fused") else torch.device("cpu")
