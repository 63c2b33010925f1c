"""Inductor compiles the inserted collectives, read from its generated code: backward-placed
reductions are issued while the backward computes, one in flight at a time."""
import re

from gradsched.sync.compiled_code import events, kernels_left


def test_backward_reductions_are_issued_while_the_backward_computes_one_in_flight_at_a_time(inductor_runs):
    # the option matrix's pp1 x dp4 Inductor row, small buckets (it trains like one process there; tests/conftest.py
    # runs it once): the last micro-batch's backward reduces every bucket
    ranks = inductor_runs["inductor_pp1_dp4_padded_m2"]
    for r in ranks:
        ev = events(r["sync_code"]["backward"])  # Inductor's output code, line by line
        last_kernel = max(e.line for e in ev if e.kind == "compute")
        issued = [e for e in ev if e.kind == "collective"]
        waits = [e for e in ev if e.kind == "wait"]
        assert len(issued) == len(waits) == r["n_buckets"] > 2
        # one in flight: each bucket's whole gradients are freed (its wait) before the next bucket's
        # reduce-scatter is issued; the last wait after the backward's last kernel
        assert all(w.line < nxt.line for w, nxt in zip(waits, issued[1:]))
        assert waits[-1].line > last_kernel
        # every bucket but the last (its gradients come out of the last kernels) is in flight
        # while the backward still computes
        assert sum(e.line < last_kernel for e in issued) >= len(issued) - 1
        # issued as soon as their gradients are, spread through the backward, not bunched up
        # before its end: on average a third of its kernels are still to run at issue
        left = kernels_left(r["sync_code"]["backward"], r["grad_group"])
        assert sum(b * f for b, f in left) / sum(b for b, _ in left) > 1 / 3
        # the code's reductions are the plan's buckets, in the plan's order (fp32)
        assert [e.nbytes for e in issued] == [4 * numel for numel, _ in r["grads"]["buckets"]]
        # the agreement's digest all-gather is issued before the backward computes anything (no kernel before it but
        # the one filling its digest: its latency hides behind the backward's compute) and waited for just before
        # the first reduction
        gather, wait = [e for e in ev if e.kind == "agreement"]
        kernels = [e.line for e in ev if e.kind == "compute"]
        assert sum(k < gather.line for k in kernels) <= 1 and sum(gather.line < k < wait.line for k in kernels) > 1
        assert wait.line < issued[0].line


def test_under_pipeline_parallelism_only_the_tied_bucket_waits_for_the_flush_where_its_all_reduce_feeds_its_reduce_scatter(
        inductor_runs):
    # the option matrix's pp2 x cp2 Inductor row (shard="params", nine small buckets; it trains like one process
    # there): stage 0's tied bucket (the embedding's) is its last, stage 1's (the head's) its first
    for r in inductor_runs["inductor_pp2_cp2_params_small_buckets_m4"]:
        (tied,) = r["tied_buckets"]
        assert r["sync_graph_buckets"] == {"backward": [b for b in range(r["n_buckets"]) if b != tied],
                                           "flush": [tied]}
        code = "\n".join(r["code"])  # the backward graphs' code, then the flush graph's
        # calls only ("...default(buf"), not Inductor's size assertions that name the op
        reduce_scatters = list(re.finditer(r"_c10d_functional\.reduce_scatter_tensor\.default\((\w+),", code))
        (all_reduce,) = re.finditer(r"_c10d_functional\.all_reduce_?\.default\((\w+),", code)
        assert len(reduce_scatters) == r["n_buckets"]  # one per bucket
        # the flush graph's only reduce-scatter is the tied bucket's, after the all-reduce, and reads the
        # all-reduced buffer: itself, or through the one kernel that scales it over the gradient group (cp 2)
        assert reduce_scatters[-1].start() > all_reduce.start() > reduce_scatters[-2].start()
        reduced, scattered = all_reduce.group(1), reduce_scatters[-1].group(1)
        between = code[all_reduce.end():reduce_scatters[-1].start()]
        assert scattered == reduced or re.search(rf"\w+\((?=[^)\n]*\b{reduced}\b)(?=[^)\n]*\b{scattered}\b)", between)
