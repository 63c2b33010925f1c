"""SyncPlan: the stage's collectives as plain data, built once, the same on ranks that agree."""
import torch

from gradsched.options import SyncOptions
from gradsched.passes.grad_ready_order import GradSpec
from gradsched.sync.sync_plan import Group, plan_sync

READY = [GradSpec("head", (64, 8), torch.float32, 0), GradSpec("w", (8, 8), torch.bfloat16, 1),
         GradSpec("b", (8,), torch.bfloat16, 2)]
DTYPES = {"head": torch.float32, "w": torch.bfloat16, "b": torch.bfloat16}


def plan(options=None, index=0, ties=None):
    return plan_sync(READY, options or SyncOptions(), stage=1, rank=3, placement="tied_at_flush",
                     grad_group=Group("dp", (1, 3), index), tie_groups={"t": Group("tie", (1, 3), index)},
                     ties=ties if ties is not None else {"head": "t"}, param_dtypes=DTYPES)


def test_the_tied_gradient_waits_for_the_flush_alone_and_the_rest_reduce_in_the_backward():
    p = plan()
    assert p.names("flush") == {"head"} and p.names("backward") == {"w", "b"}


def test_the_pass_spec_comes_from_the_plan():
    spec = plan(index=1).spec("backward", {"w": 1, "b": 2}, accumulate=True)
    assert (spec.group, spec.group_size, spec.shard_rank, spec.tie_groups) == ("dp", 2, 1, {"t": "tie"})
    assert [s.name for b in spec.layout.buckets for s in b.slots] == ["w", "b"]


def test_parameters_are_gathered_in_their_own_dtype():
    p = plan()
    assert [p.gather_dtypes[p.layout.locate(n)[0].index] for n in ("head", "w")] == [torch.float32, torch.bfloat16]


def test_the_fingerprint_is_equal_for_equal_plans_and_tells_different_ones_apart():
    assert plan().fingerprint() == plan().fingerprint()
    assert plan().fingerprint() != plan(SyncOptions(bucket_mb=1e-5)).fingerprint()
    assert plan().fingerprint() != plan(ties={}).fingerprint()
