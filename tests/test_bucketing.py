"""Bucket planning: ready order, shard-sized buckets, aligned ties."""
import torch

from gradsched.passes.bucketing import owned_range, place_buckets, plan_buckets, round_up
from gradsched.passes.grad_ready_order import GradSpec


def specs(*sizes, dtype=torch.float32):
    return [GradSpec(f"p{i}", (n,), dtype, i) for i, n in enumerate(sizes)]


def test_buckets_follow_ready_order_and_capacity():
    cap = 200 * 4 / 2**20  # 200 fp32 elements
    layout = plan_buckets(specs(100, 100, 100, 100), bucket_mb=cap, shards=1, tail_mb=cap)
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["p0", "p1"], ["p2", "p3"]]
    assert [s.offset for s in layout.buckets[0].slots] == [0, 100]


def test_the_last_bucket_nothing_can_overlap_is_small_but_holds_the_last_gradient():
    elems = lambda n: n * 4 / 2**20  # noqa: E731
    small = plan_buckets(specs(100, 100, 100, 100), bucket_mb=elems(800), shards=1, tail_mb=elems(100))
    assert [[s.name for s in b.slots] for b in small.buckets] == [["p0", "p1", "p2"], ["p3"]]
    big_last = plan_buckets(specs(10, 10, 1000), bucket_mb=elems(800), shards=1, tail_mb=elems(100))
    assert [[s.name for s in b.slots] for b in big_last.buckets] == [["p0", "p1"], ["p2"]]


def test_with_a_tied_gradient_last_the_backwards_own_last_bucket_is_the_small_one():
    # under placement="tied_at_flush" the tied bucket waits for the flush: the untied bucket before it
    # is the last the backward reduces
    ready = specs(100, 100, 100) + [GradSpec("emb", (300,), torch.float32, 3)]
    layout = plan_buckets(ready, bucket_mb=100.0, shards=1, tail_mb=100 * 4 / 2**20, ties={"emb": "t"},
                          align_ties=True)
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["p0", "p1"], ["p2"], ["emb"]]


def test_bucket_sizes_are_multiples_of_the_shard_count():
    layout = plan_buckets(specs(7, 5, 3), bucket_mb=1.0, shards=4)
    assert all(b.numel % 4 == 0 for b in layout.buckets)
    assert layout.buckets[0].numel == round_up(15, 4)


def test_a_dtype_change_starts_a_new_bucket_unless_reduced_in_one_dtype():
    mixed = specs(4) + [GradSpec("h", (4,), torch.bfloat16, 1)]
    assert len(plan_buckets(mixed, bucket_mb=1.0, shards=2).buckets) == 2
    one = plan_buckets(mixed, bucket_mb=1.0, shards=2, reduce_dtype=torch.float32)
    assert len(one.buckets) == 1 and one.buckets[0].dtype == torch.float32


def test_aligned_tie_gets_a_bucket_whose_layout_depends_only_on_its_size():
    # the same weight ready first on one stage and last on the other
    first = [GradSpec("head", (10, 3), torch.float32, 0)] + specs(50, 7)
    last = specs(13) + [GradSpec("emb", (10, 3), torch.float32, 1)]
    a = plan_buckets(first, bucket_mb=1.0, shards=4, ties={"head": "t"}, align_ties=True)
    b = plan_buckets(last, bucket_mb=1.0, shards=4, ties={"emb": "t"}, align_ties=True)
    (ba, sa), (bb, sb) = a.locate("head"), b.locate("emb")
    assert (sa.offset, ba.numel, len(ba.slots)) == (sb.offset, bb.numel, len(bb.slots)) == (0, 32, 1)
    owned = [owned_range(ba.numel, sa.offset, sa.numel, 4, k) for k in range(4)]
    assert owned == [(0, 8), (8, 16), (16, 24), (24, 30)]


def test_unaligned_ties_land_at_different_offsets():
    first = [GradSpec("head", (30,), torch.float32, 0)] + specs(50)
    last = specs(13) + [GradSpec("emb", (30,), torch.float32, 1)]
    a = plan_buckets(first, bucket_mb=1.0, shards=2, ties={"head": "t"})
    b = plan_buckets(last, bucket_mb=1.0, shards=2, ties={"emb": "t"})
    assert a.locate("head")[1].offset == 0 and b.locate("emb")[1].offset == 13


def test_the_tied_at_flush_placement_sends_exactly_the_buckets_with_a_tied_gradient_to_the_flush():
    # unsafe_rs_first's layout (no alignment): the tied gradient shares a bucket with others
    for align in (True, False):
        layout = plan_buckets(specs(6, 10, 6, 4), bucket_mb=16 * 4 / 2**20, shards=2, ties={"p1": "t"},
                              align_ties=align)
        placed = place_buckets(layout, "tied_at_flush")
        flush = [b.index for b in placed["flush"].buckets]
        assert flush == [b.index for b in layout.buckets if any(s.name == "p1" for s in b.slots)]
        assert sorted(flush + [b.index for b in placed["backward"].buckets]) == [b.index for b in layout.buckets]


def test_placement_backward_or_flush_puts_every_bucket_in_one_graph_and_an_untied_stage_has_no_flush():
    layout = plan_buckets(specs(6, 10), bucket_mb=8 * 4 / 2**20, shards=2)
    assert list(place_buckets(layout, "flush")) == ["flush"] and list(place_buckets(layout, "backward")) == ["backward"]
    assert list(place_buckets(layout, "tied_at_flush")) == ["backward"]


def test_after_several_stage_graphs_a_bucket_reduces_early_only_once_all_its_gradients_are_final():
    from gradsched.passes.bucketing import place_after
    layout = plan_buckets(specs(100, 100, 100, 100), bucket_mb=100 * 4 / 2**20, shards=1, tail_mb=100 * 4 / 2**20)
    # p0, p1 final at the first stage graph's end, p2 at the second's, p3 (a tie within the rank) at the last's
    got = place_after(layout, {"p0": 0, "p1": 0, "p2": 1, "p3": 2}, points=3)
    assert {w: [b.index for b in lay.buckets] for w, lay in got.items()} == {"early0": [0, 1], "early1": [2],
                                                                            "flush": [3]}
    shared = plan_buckets(specs(100, 100), bucket_mb=1.0, shards=1, tail_mb=1.0)  # one bucket, final at 0 and 1
    assert [len(b.slots) for b in shared.buckets] == [2]
    assert list(place_after(shared, {"p0": 0, "p1": 1}, points=3)) == ["early1"]  # at its later gradient's point
    tied = plan_buckets(specs(100, 100), bucket_mb=1.0, shards=1, ties={"p0": "t"})
    assert list(place_after(tied, {"p0": 0, "p1": 0}, points=2)) == ["flush"]  # its all-reduce meets another rank's


def test_a_ranks_gradients_are_ordered_and_final_by_the_order_its_stage_graphs_finish():
    from gradsched.sync.rank_stages import finishing_points
    first, second = specs(1, 2), [GradSpec("q", (3,), torch.float32, 0), GradSpec("p0", (1,), torch.float32, 1)]
    ready, final_at = finishing_points([first, second], order=(1, 0))  # the second graph finished first
    assert [r.name for r in ready] == ["q", "p0", "p1"]
    assert final_at == {"q": 0, "p0": 1, "p1": 1}  # p0, written by both (a tie on the rank), once both are done
