"""Inductor compiles the inserted collectives: they are in the generated code, and the
backward-placed reductions start before the backward's last matmul (they can overlap)."""
import re

from gradsched.launch import run_ranks
from gradsched.tied_training import Job, compare, rank_main, reference


def first(ops, needle):
    return next(i for i, op in enumerate(ops) if needle in op)


def last(ops, needle):
    return max(i for i, op in enumerate(ops) if needle in op)


def test_backward_graph_reductions_are_compiled_by_inductor_and_start_before_the_backward_ends():
    job = Job(pp=1, dp=2, steps=2, capture_code=True, options={"compiler": "inductor", "bucket_mb": 0.01})
    ranks = run_ranks(rank_main, 2, job, timeout_s=400)
    code = "\n".join(ranks[0]["code"])
    assert "_c10d_functional.reduce_scatter_tensor" in code and "_c10d_functional.wait_tensor" in code
    ops = ranks[0]["sync_graph_ops"]
    assert first(ops, "reduce_scatter_tensor") < last(ops, "aten.mm")
    assert compare(reference(job), ranks)["max_abs_diff"] < 1e-5


def test_under_pipeline_parallelism_only_the_tied_bucket_waits_for_the_flush_where_its_all_reduce_feeds_its_reduce_scatter():
    job = Job(pp=2, dp=1, steps=2, capture_code=True, options={"compiler": "inductor"})
    ranks = run_ranks(rank_main, 2, job, timeout_s=400)
    for r in ranks:
        (tied,) = r["tied_buckets"]  # stage 0: the embedding's bucket is last; stage 1: the head's is first
        assert r["sync_graph_buckets"] == {"backward": [b for b in range(r["n_buckets"]) if b != tied],
                                           "flush": [tied]}
        code = "\n".join(r["code"])  # the backward graphs' code, then the flush graph's
        # calls only ("...default(buf"), not Inductor's size assertions that name the op
        reduce_scatters = list(re.finditer(r"_c10d_functional\.reduce_scatter_tensor\.default\((\w+),", code))
        (all_reduce,) = re.finditer(r"_c10d_functional\.all_reduce_?\.default\((\w+),", code)
        assert len(reduce_scatters) == r["n_buckets"]  # one per bucket
        # the flush graph's only reduce-scatter is the tied bucket's, after the all-reduce: dp=1, so
        # nothing scales between them and it reads the all-reduced buffer itself
        assert reduce_scatters[-1].start() > all_reduce.start() > reduce_scatters[-2].start()
        assert reduce_scatters[-1].group(1) == all_reduce.group(1)
    cmp = compare(reference(job), ranks)
    assert cmp["max_abs_diff"] < 1e-5 and cmp["tied_bitwise_equal"]
