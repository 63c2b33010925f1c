"""Which buckets of a rank of several stages reduce early (gradsched.sync.rank_stages.build_union): one process,
plain data; nothing is compiled or run (the graphs compile at their first call)."""
import pytest
import torch

from gradsched.options import SyncOptions
from gradsched.passes.grad_ready_order import GradSpec
from gradsched.sync.rank_stages import StagePart, build_union
from gradsched.sync.stage_setup import StageSetup
from gradsched.sync.sync_plan import Group


def parts():
    """Two stage graphs of 1000 elements each, in the order they compiled: the rank's later stage ("late.*",
    whose backward comes first) and its first ("first.*")."""
    out = []
    for stage in ("late", "first"):
        names = [f"{stage}.w{i}" for i in range(4)]
        params = {n: torch.nn.Parameter(torch.zeros(250)) for n in names}
        ready = [GradSpec(n, (250,), torch.float32, i) for i, n in enumerate(names)]
        out.append(StagePart(ready, params, dict(enumerate(names)), None, None))
    return out


def setup(ranks: int, placement: str = "tied_at_flush") -> StageSetup:
    group = Group("grad", tuple(range(ranks)), 0)
    return StageSetup(0, 0, "rank 0", placement, group, group, {}, {}, ())


def options(**kw) -> SyncOptions:
    return SyncOptions(bucket_mb=1000 * 4 / 2**20 / 2, compiler="eager", **kw)  # two buckets a stage graph


def where(built) -> dict:
    return {w: sorted({s.name.split(".")[0] for b in g.layout.buckets for s in b.slots}) for w, g in built.graphs.items()}


def test_the_buckets_of_the_stage_that_finishes_first_reduce_early_and_the_rest_in_the_flush():
    built = build_union(parts(), setup(2), options(), order=(0, 1))
    assert where(built) == {"early0": ["late"], "flush": ["first"]} and built.order == (0, 1)


def test_the_order_the_stages_finished_in_decides_not_the_order_they_compiled_in():
    built = build_union(parts(), setup(2), options(), order=(1, 0))
    assert where(built) == {"early0": ["first"], "flush": ["late"]}


@pytest.mark.parametrize("case", ["one_rank", "placement_flush", "all_reduce", "no_order"])
def test_no_early_reduction_where_it_would_buy_nothing_or_is_not_asked_for(case):
    kw = {"one_rank": (setup(1), options()), "placement_flush": (setup(2, "flush"), options()),
          "all_reduce": (setup(2), options(shard=False)), "no_order": (setup(2), options())}[case]
    built = build_union(parts(), *kw, order=() if case == "no_order" else (0, 1))
    assert list(built.graphs) == ["flush"] and built.order == ()
