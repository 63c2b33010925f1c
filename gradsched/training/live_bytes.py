"""What a training step holds, counted as it runs: the dry run's (gradsched.dryrun) measure.

LiveBytes is a dispatch mode that adds up the storages the ops it sees create, and their peak;
WORKSPACE and RUNTIME are what a backend or the device runtime holds beyond any tensor, measured
where the comments say. No modelling: what is counted is what ran, on meta tensors or real ones.

May import: torch only.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


# Scratch memory a backend's collective allocates through torch's allocator while it runs, over its
# result, in bytes of the collective's whole buffer. Measured with torch 2.13's ProcessGroupGloo on CPU
# (tests/test_dryrun.py measures it again): a reduce-scatter all-reduces a copy of its input and keeps its
# shard; an all-gather gathers into a list of tensors and concatenates them. NCCL works in its own buffers.
WORKSPACE = {"gloo": {"reduce_scatter_tensor": 1.0, "all_gather_into_tensor": 1.0}, "nccl": {}, "fake": {}}

# Bytes a training process holds on its device beyond any tensor: on CUDA, cuBLAS's workspace, one per
# thread that multiplies (the forward's and autograd's backward thread), 32 MiB each on Hopper. Measured
# on an H100 (torch 2.11): one fp32 matmul leaves 33,554,432 bytes allocated, a training step two blocks
# of that size that no tensor owns.
RUNTIME = {"gloo": 0, "nccl": 2 * 32 * 2**20, "fake": 0}  # fake: torch's fake process group, on CPU


# the c10d ops behind torch.distributed's calls (the optimizer's), by the functional op's name
C10D_NAMES = {"_allgather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
              "allreduce": "all_reduce", "allgather_into_tensor_coalesced": "all_gather_into_tensor",
              "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor"}


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages that ops create while it is active and that are still alive, and
    their peak; a view or an in-place result adds nothing (its storage is its input's). Collectives issued are tallied by op
    and group, and their backend's scratch memory (WORKSPACE) counts while they are in flight (a
    functional collective's from its issue to its wait).
    Compiled graphs run through it: Dynamo compiles as without it (ignore_compile_internals)."""

    def __init__(self, backend: str = "nccl"):
        super().__init__()
        self.workspace = WORKSPACE[backend]
        self.now = self.peak = 0
        self._seen = WeakIdKeyDictionary()
        self.collectives: dict[tuple[str, str], int] = {}
        self._in_flight: dict[int, tuple] = {}  # a functional collective's result -> (scratch bytes, its input)

    # checkpointing's rng HOPs (run_and_save_rng_state, run_with_rng_state) in an eagerly run graph: each runs
    # its one op without the mode, and its outputs are counted here like any op's
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @torch._dynamo.disable  # it runs inside compiled graphs: its own frames are not the model's to trace
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.wait_tensor.default:
            scratch, _ = self._in_flight.pop(args[0].untyped_storage()._cdata, (0, None))  # its input may die now
            self.now -= scratch
            if args[0].is_meta:  # the meta kernel would make a new tensor; a meta collective is done at issue
                return args[0]
            return func(*args, **(kwargs or {}))
        out = _meta_rng(func, args, kwargs) if isinstance(func, HigherOrderOperator) else None
        out = func(*args, **(kwargs or {})) if out is None else out
        # a view or an in-place op's result lives in its input's storage: nothing new, and its input may
        # predate the mode (a parameter, the optimizer's state), already counted as held
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._add(t.untyped_storage())
        if func.namespace in ("_c10d_functional", "c10d"):
            self._tally(func, args, out)
        return out

    def _add(self, storage) -> None:
        if storage in self._seen:
            return
        n = storage.nbytes()
        self._seen[storage] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.now -= n

    def _tally(self, func, args, out) -> None:
        """Bytes of the collective's whole buffer (an all-gather's output, a reduce-scatter's input): the
        largest of its first two arguments (a functional op's input, an in-place c10d op's output and input)
        and its result."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in tree_leaves(ts)  # noqa: E731
                              if isinstance(t, torch.Tensor))
        strings = [a for a in args if isinstance(a, str)]
        group = strings[-1] if strings else None  # a functional collective's last string names its group
        if group is None:
            pg = next((a for a in tree_leaves(args) if isinstance(a, (dist.ProcessGroup, torch.ScriptObject))), None)
            if isinstance(pg, torch.ScriptObject):  # how a c10d op receives its group
                pg = dist.ProcessGroup.unbox(pg)
            group = pg.group_name if pg is not None else "?"
        op = func.__name__.split(".")[0].rstrip("_")
        op = C10D_NAMES.get(op, op)
        nbytes = max(size(a) for a in (*args[:2], out))
        self.collectives[(op, group)] = self.collectives.get((op, group), 0) + nbytes
        scratch = int(self.workspace.get(op, 0) * nbytes)
        if func.namespace == "_c10d_functional" and isinstance(out, torch.Tensor):
            # from issue to wait the backend holds its input (NCCL stashes it, Inductor keeps it) and its
            # scratch, while the graph computes on
            self._in_flight[out.untyped_storage()._cdata] = (scratch, args[0])
            self.now += scratch
            self.peak = max(self.peak, self.now)
        else:  # a c10d op waited for by its caller (the optimizer's): held while it runs
            self.peak = max(self.peak, self.now + scratch)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped), meta storages included."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def _meta_rng(hop, args, kwargs):
    """torch's rng HOPs have no meta kernel (the dry run's graphs, checkpointed): the op alone, and a state
    of the CPU generator's shape; None for any other call."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs))):
        return None
    if hop.__name__ == "run_and_save_rng_state":
        op, *rest = args
        return torch.get_rng_state(), op(*rest, **(kwargs or {}))
    if hop.__name__ == "run_with_rng_state":
        _, op, *rest = args
        return op(*rest, **(kwargs or {}))
    return None
