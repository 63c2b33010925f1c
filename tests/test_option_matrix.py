"""Every option of the README's table, under every layout, trains like one process, gradient for gradient.

Each case trains the tiny tied GPT on 4 gloo processes and compares, against the
unsplit model trained in one process on the whole global batch:
  - the reduced gradients of the first and the last step (each rank's shard against the matching
    slice of the reference's .grad, or the full .grad under shard=False), relative to
    the largest reference gradient: scale errors (a sum for a mean, 1/microbatches
    twice, a tie counted twice) show here, where AdamW's parameters hide them;
  - the loss of every step (mean over the labelled tokens of the global batch);
  - every parameter after the optimizer steps, and the tied copies bitwise equal.

The eager cases run in one set of processes (start-up dominates); a representative
slice runs again under Inductor, the default compiler. docs/parallelism.md lists the cases
(tests/test_docs.py holds its table to these).
"""
import re

import pytest

from gradsched.launch import run_ranks
from gradsched.training.pipeline_schedule import CUT_BACKWARD, V_SHAPED as V
from tied_training import Job, abs_diff, compare, gradient_error, rank_jobs, reference
from tiny_gpt import GPTConfig

GRAD_TOL = 1e-5  # relative to the largest gradient; fp32 summation order differs, nothing else
TOL = 1e-5


def job(pp, dp, cp=1, *, optimizer="sgd", labels="padded", loss="mean", variant="", vocab=64, steps=2, clip=0.0,
        param_groups="", host_reads=(), inject_host_read=False, capture_code=False, schedule="auto", layers=2,
        ties=None, plain_optimizer=False, split_points=None, **options):
    # several stages a rank (zbv, interleaved_1f1b, stages_per_rank): pp x that many stages, split evenly
    stages = pp * options.get("stages_per_rank", 2 if schedule in ("zbv", "dualpipev", "interleaved_1f1b") else 1)
    split_points = split_points or tuple(f"blocks.{i * layers // stages}" for i in range(1, stages))
    return Job(pp=pp, dp=dp, cp=cp, steps=steps, optimizer=optimizer, labels=labels, loss=loss, variant=variant,
               schedule=schedule, split_points=split_points,
               config=GPTConfig(vocab=vocab, layers=layers), lr=(0.5 if optimizer == "sgd" else 1e-3) / (128 if loss == "sum" else 1),
               clip=clip, param_groups=param_groups, host_reads=host_reads, inject_host_read=inject_host_read,
               capture_code=capture_code, ties=ties, plain_optimizer=plain_optimizer, options={"compiler": "eager", **options})


CLIP = 0.05  # below every step's gradient norm in these cases (asserted): the clipping acts


CASES = {
    # layouts: GPipe and 1F1B, micro-batches, pp=1 in the backward graph
    "pp2_dp2_1f1b_m4_adamw_param_groups": job(2, 2, microbatches=4, optimizer="adamw", param_groups="decay_matrices",
                                              steps=3),
    # two ties between one stage pair, of equal sizes (silent before)
    "pp2_dp2_two_ties_equal_sizes_clip_shard_aligned": job(2, 2, variant="hidden_tie", vocab=32, microbatches=2,
                                                           mode="shard_aligned", clip=CLIP),
    # the tie declared by hand (parallelize's ties=), not discovered
    "pp2_dp2_ties_declared_m2": job(2, 2, microbatches=2, ties=[{0: "wte.weight", 1: "lm_head.weight"}]),
    # placement, both ways round (the second under GPipe, with the rank checks off and its graphs dumped)
    "pp2_dp2_placement_backward_no_tie": job(2, 2, variant="untied", placement="backward", microbatches=2),
    "pp2_dp2_gpipe_placement_flush_no_rank_check_dumped_m2": job(2, 2, schedule="gpipe", placement="flush",
                                                                 microbatches=2, check_ranks=False,
                                                                 dump_dir="/tmp/gradsched-matrix-dump"),
    # average=False: loss_fn is a sum, gradients are summed
    "pp2_dp2_sum_all_reduce_clip_m2": job(2, 2, loss="sum", average=False, shard=False, clip=CLIP, microbatches=2),
    # torch.optim's own SGD over model.parameters(), built before the first step (shard=False): the rank trains the
    # user's tied Parameter (the split's copy of it was trained before, and the user's never stepped)
    "pp2_dp2_all_reduce_plain_sgd_m2": job(2, 2, shard=False, microbatches=2, plain_optimizer=True),
    # buckets: many small ones, padded (a vocab of 97; with clipping below), another reduce dtype; pp=1 reduces
    # them in the backward graph
    "pp1_dp4_backward_m2_reduce_fp64_small_buckets": job(1, 4, vocab=97, bucket_mb=0.004, reduce_dtype="float64",
                                                         microbatches=2),
    # context parallelism
    # the ring's backward as B and W, in a V (two stages a rank) under DualPipeV
    # (the accumulation modes ride on rows of other options: each row of its own cost the suite ~10 s)
    "pp2_cp2_dualpipev_fp32_blocks_m4": job(2, 1, 2, schedule="dualpipev", layers=4, microbatches=4,
                                            bucket_mb=0.004, accumulate="fp32_blocks"),
    "dp2_cp2_plain_layout_allgather_accumulate_input": job(1, 2, 2, load_balance=False, comm="allgather",
                                                           accumulate="input"),
    "dp2_cp2_a2a_clip": job(1, 2, 2, comm="a2a", clip=CLIP),
    # clipping by the global norm (ties counted once, shards summed), and parameter groups; shard_aligned mode,
    # shard=False (plain data parallel)
    "pp2_dp2_clip_small_padded_buckets": job(2, 2, vocab=97, bucket_mb=0.004, clip=CLIP, microbatches=2),
    "pp1_dp4_param_groups_all_reduce_m2": job(1, 4, optimizer="adamw", param_groups="decay_matrices", steps=3,
                                              shard=False, microbatches=2),
    # zero bubble (ZB-H1): each backward as B now and W later; the tie and the reductions after the last W
    "pp2_dp2_zb1p_params_m4": job(2, 2, schedule="zb1p", shard="params", microbatches=4),
    "pp2_dp2_zb1p_untied_clip_m2": job(2, 2, schedule="zb1p", variant="untied", clip=CLIP, microbatches=2),
    # four stages: the tie spans the first and the last, the middle two hold no copy (they failed to start before)
    "pp4_zb1p_m4": job(4, 1, schedule="zb1p", layers=4, microbatches=4),
    # the V at pp 4 (eight stages, the tie's copies on rank 0), as benchmarks/pipeline.py runs it on a GPU machine
    "pp4_zbv_clip_m8": job(4, 1, schedule="zbv", layers=8, microbatches=8, clip=CLIP),
    # two stages a rank: in a V (the tie's copies on rank 0, one Parameter), looped (the tie across the ranks)
    "pp2_dp2_zbv_adamw_small_buckets_m4": job(2, 2, schedule="zbv", layers=4, microbatches=4, optimizer="adamw",
                                              steps=3, bucket_mb=0.004),
    # a summed loss (average=False) with float64 reductions in a V (the tie one Parameter, early reductions), its
    # stages begun inside blocks (at a block's MLP: the residual crosses the boundary beside the norm's input), the
    # first and the last a half block each, as balanced_split_points may cut them
    "pp2_dp2_zbv_sum_reduce_fp64_split_in_blocks_m4": job(2, 2, schedule="zbv", layers=4, microbatches=4, loss="sum",
                                                          average=False, reduce_dtype="float64",
                                                          split_points=("blocks.0.ln2", "blocks.2", "blocks.3.ln2")),
    # the same with AdamW in a V (the tie's copies one Parameter on rank 0: the user's)
    "pp2_dp2_zbv_all_reduce_plain_adamw_m4": job(2, 2, schedule="zbv", layers=4, microbatches=4, optimizer="adamw",
                                                 steps=3, shard=False, plain_optimizer=True),
    "pp2_dp2_interleaved_1f1b_untied_clip_all_reduce_m4": job(2, 2, schedule="interleaved_1f1b", layers=4,
                                                              variant="untied", clip=CLIP, shard=False, microbatches=4),
    "pp2_dp2_zb1p_two_stages_a_rank_m4": job(2, 2, schedule="zb1p", stages_per_rank=2, layers=4, microbatches=4,
                                             bucket_mb=0.004),
}

STEADY = (2, 3, 4)  # steps 3 to 5, after warm-up: tests/test_host_reads.py reads what they read on the host

INDUCTOR = {  # the default compiler end to end: flush graph, backward sync variant, padding, CP
    # (each row costs the suite a cold compile of its graphs, so one row holds several options; the two pp2
    # rows also record steps 3 to 5's host reads, with CP off and on, shard=True and "params")
    "inductor_pp2_dp2_zb1p_padded_m4_clip_param_groups": job(2, 2, vocab=97, microbatches=4, optimizer="adamw",
                                                             schedule="zb1p", param_groups="decay_matrices",
                                                             clip=CLIP, steps=5, host_reads=STEADY,
                                                             inject_host_read=True, compiler="inductor"),
    "inductor_pp1_dp4_padded_m2": job(1, 4, vocab=97, microbatches=2, bucket_mb=0.004, compiler="inductor"),
    # a V with its early reductions returned in flight from Inductor's code (shard=False under Inductor:
    # tests/test_entry_points.py)
    "inductor_pp2_dp2_zbv_small_buckets_m4": job(2, 2, schedule="zbv", layers=4, microbatches=4, bucket_mb=0.004,
                                                 steps=5, host_reads=STEADY, compiler="inductor"),
    # shard="params" with many small buckets: each gathered one bucket ahead in the compiled code; under GPipe
    "inductor_pp2_cp2_params_small_buckets_m4": job(2, 1, 2, microbatches=4, shard="params", bucket_mb=0.004,
                                                    steps=5, host_reads=STEADY, capture_code=True,
                                                    schedule="gpipe", compiler="inductor"),
    # the looped schedules of two stages a rank: interleaved 1F1B (the tie across the ranks), DualPipeV (in a V),
    # with shard=True and with their parameters sharded (ZeRO-3), each stage graph gathering its own buckets
    "inductor_pp2_dp2_interleaved_1f1b_clip_m4": job(2, 2, schedule="interleaved_1f1b", layers=4, microbatches=4,
                                                     clip=CLIP, compiler="inductor"),
    "inductor_pp2_dp2_interleaved_1f1b_params_m4": job(2, 2, schedule="interleaved_1f1b", layers=4, microbatches=4,
                                                       shard="params", compiler="inductor"),
    "inductor_pp2_dp2_dualpipev_params_clip_m4": job(2, 2, schedule="dualpipev", layers=4, microbatches=4, clip=CLIP,
                                                     shard="params", compiler="inductor"),
    # a Hugging Face Llama in a V, under Inductor: its rotary embeddings, computed in stage 0 for every layer,
    # passed through; small buckets: each stage's reduced early, while the rank's other stage computes
    "inductor_pp2_dp2_zbv_hf_llama_small_buckets_m4": Job(model="hf_llama", pp=2, dp=2, steps=2, optimizer="adamw",
                                                          labels="padded", schedule="zbv", config=GPTConfig(layers=4),
                                                          hf_stages=4, options={"compiler": "inductor",
                                                                                "microbatches": 4, "bucket_mb": 0.004}),
    # (all-to-all under Inductor: tests/test_masked_attention.py compiles the masked hybrid, all-to-all and ring,
    # against fp64; shard=False under Inductor: tests/test_entry_points.py)
    # (the plain layout's causal ring, where ranks do unequal work, keeps every collective in each rank's compiled
    # graphs: tests/test_collectives_kept.py, one process; trained eagerly above)
}


def _fix(job_):  # options that are dtypes travel as names (readable case table)
    rd = job_.options.get("reduce_dtype")
    if isinstance(rd, str):
        import torch
        job_.options["reduce_dtype"] = getattr(torch, rd)
    return job_


def run_jobs(cases: dict, world: int = 4) -> dict:
    """Every job of `cases` on one set of `world` ranks: name -> the ranks' results."""
    jobs = [_fix(j) for j in cases.values()]
    per_rank = run_ranks(rank_jobs, world, jobs, timeout_s=900)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(cases)}


@pytest.fixture(scope="module")
def eager_runs():
    return run_jobs(CASES)


def assert_like_one_process(job_, ranks):
    errors = [r[1] for r in ranks if isinstance(r, tuple)]
    assert not errors, errors[0]
    ref = reference(job_)
    assert gradient_error(ref, ranks) < GRAD_TOL
    # the last step's too: its labelled count differs from the step before's, whose count scaled its weights
    last = gradient_error({"grads": ref["last_grads"]}, [{**r, "grads": r["last_grads"]} for r in ranks])
    assert last < GRAD_TOL, last
    cmp = compare(ref, ranks)
    assert cmp["missing"] == [] and cmp["uncovered"] == []
    assert cmp["max_abs_diff"] < TOL and cmp["tied_bitwise_equal"]
    for r in ranks:
        if r["losses"][0] is not None:  # the last stage: the global batch's loss, on every rank
            for got, want in zip(r["losses"], ref["losses"]):
                assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    if job_.clip:  # every rank returns the global norm one process computes, before clipping
        assert min(ref["norms"]) > job_.clip
        for r in ranks:
            assert all(abs(got - want) <= 1e-6 * want for got, want in zip(r["norms"], ref["norms"])), \
                (r["norms"], ref["norms"])
    assert all(r["verifier"] == "ok" for r in ranks)
    assert all(r["sync_runs"] == job_.steps for r in ranks)  # each collective once per step
    for r in ranks:
        assert r["sync_graph_buckets"] == expected_placement(job_, r)
    if job_.plain_optimizer:  # built over the whole model before the split: it holds this rank's stage alone after
        assert all(r["plain_optimizer_bytes"] == r["stage_param_bytes"] for r in ranks), \
            [(r["plain_optimizer_bytes"], r["stage_param_bytes"]) for r in ranks]
    for r in ranks:  # one truth for parameters: the trained ones, each once; the whole model's state dict
        assert sorted(r["named_parameters"]) == sorted(r["params"])
        assert list(r["state_dict"]) == list(ref["state_keys"])
        assert max(abs_diff(v, ref["params"][k]) for k, v in r["state_dict"].items()) < TOL


def test_zero_bubble_runs_weight_gradients_after_later_input_gradients(eager_runs, inductor_runs):
    runs = {**eager_runs, **inductor_runs}
    for name, case in {**CASES, **INDUCTOR}.items():
        if case.schedule in CUT_BACKWARD:  # some stage ran a W after the B of a later micro-batch
            assert max(r["w_queued_max"] for r in runs[name]) >= 2, name
        else:  # the backward whole: nothing queued
            assert all(r["w_queued_max"] == 0 for r in runs[name]), name


def test_under_the_v_the_ties_copies_are_one_parameter_on_rank_0_and_no_collective_sums_them(eager_runs):
    for name in ("pp2_dp2_zbv_adamw_small_buckets_m4", "pp2_cp2_dualpipev_fp32_blocks_m4"):
        v = eager_runs[name]
        assert all(r["tied_bytes_per_step"] == 0 and r["ties"] == [] for r in v), name
        assert all(("tie on this rank: wte.weight = lm_head.weight" in r["report"]) == (r["stage"] == 0) for r in v)
        # the split's copies of it under the other name on each of rank 0's stages, never read: released
        assert all(r["unread_tied_bytes"] == 0 for r in v), [r["unread_tied_bytes"] for r in v]
    # looped, the same model's first and last stage sit on different ranks: the tie is summed over them
    looped = eager_runs["pp2_dp2_zb1p_two_stages_a_rank_m4"]
    assert all(r["tied_bytes_per_step"] > 0 and len(r["ties"]) == 1 for r in looped)


def expected_placement(job_, r) -> dict:
    """Which graph reduces which buckets: under pp > 1 (split), a bucket waits for the flush only
    if it holds a tied gradient; pp = 1 reduces in the backward. Several stages a rank: the flush, but in a V
    or looped, with B and W (shard=True or "params"), the untied buckets of each of the rank's stages but the last
    to finish reduce early, as that stage ends ("early0" the first to finish: the V's second leg, or the last
    loop's stage, then the loop before it)."""
    buckets = list(range(r["n_buckets"]))
    if job_.schedule in ("zbv", "dualpipev", "interleaved_1f1b") or job_.options.get("stages_per_rank", 1) > 1:
        if job_.schedule not in CUT_BACKWARD or job_.options.get("shard", True) not in (True, "params") or \
                job_.options.get("placement", "auto") == "flush" or job_.dp * job_.cp == 1:
            # no one backward graph holds all of a rank's gradients; a gradient group of one rank reduces by copying
            return {"flush": buckets}
        # the rank's stages in the order their backwards end, the last excepted
        finishing = [2 * job_.pp - 1 - r["stage"]] if job_.schedule in V else [
            r["stage"] + job_.pp * k for k in range(job_.options["stages_per_rank"] - 1, 0, -1)]
        out = {}
        for i, stage in enumerate(finishing):
            early = [b for b in buckets if b not in r["tied_buckets"]
                     and {stage_of(r["split_points"], n) for n in r["bucket_params"][b]} == {stage}]
            if early:
                out[f"early{i}"] = early
        flush = [b for b in buckets if all(b not in v for v in out.values())]
        return {**out, **({"flush": flush} if flush else {})}
    placement = job_.options.get("placement", "auto")
    if placement == "auto":
        placement = "backward" if job_.pp == 1 else "tied_at_flush"
    if placement != "tied_at_flush":
        return {placement: buckets}
    parts = {"backward": [b for b in buckets if b not in r["tied_buckets"]], "flush": sorted(r["tied_buckets"])}
    return {k: v for k, v in parts.items() if v}


BLOCK_ORDER = ("ln1", "qkv", "proj", "ln2", "fc", "out")  # the tiny GPT block's submodules in the order they run


def stage_of(split_points: list, name: str) -> int:
    """The stage of parameter `name` of the tiny GPT or a Hugging Face decoder (the tied embedding is the first
    stage's; the final norm and the LM head the last's). A split point may begin a stage inside a tiny GPT block
    ("blocks.3.ln2": its MLP on)."""
    def place(path: str) -> tuple:
        layer, sub = re.search(r"(?:blocks|layers)\.(\d+)(?:\.(\w+))?", path).groups()
        return int(layer), BLOCK_ORDER.index(sub) if sub in BLOCK_ORDER else 0
    if re.search(r"(?:blocks|layers)\.\d+\.", name):
        return sum(place(p) <= place(name) for p in split_points)
    return len(split_points) if re.search(r"(^|\.)(ln_f|norm|lm_head)\.", name) else 0  # (a HF model's model.model.norm)


def test_in_a_v_a_stages_buckets_reduce_while_the_ranks_other_stage_still_computes(eager_runs, inductor_runs):
    runs = {**eager_runs, **inductor_runs}
    for name in ("pp2_dp2_zbv_adamw_small_buckets_m4", "pp2_cp2_dualpipev_fp32_blocks_m4", "inductor_pp2_dp2_zbv_small_buckets_m4",
                 "pp2_dp2_zb1p_two_stages_a_rank_m4", "inductor_pp2_dp2_zbv_hf_llama_small_buckets_m4"):  # (looped: its ties across the ranks wait for the flush)
        for r in runs[name]:
            assert "early0" in r["sync_graph_buckets"], (name, r["sync_graph_buckets"])
            # the first step plans them at its flush, where they run; every later step issues them when one of the
            # rank's two stages has finished its W and the other has not (its remaining B and W overlap them)
            assert r["early_log"] == [("early0", 2)] + [("early0", 1)] * (CASES.get(name, INDUCTOR.get(name)).steps - 1)
    for r in inductor_runs["inductor_pp2_dp2_zbv_small_buckets_m4"]:  # Inductor's code returns them un-waited
        code = r["sync_code"]["early0"]
        issued = re.findall(r"(buf\d+) = torch.ops._c10d_functional.reduce_scatter_tensor.default\((buf\d+),", code)
        shapes = re.findall(r"assert_size_stride\(buf\d+, \((\d+), \).*reduce_scatter_tensor", code)
        early = r["sync_graph_buckets"]["early0"]
        # one reduce-scatter a bucket, in bucket order (each shard half of its bucket), none waited for in the
        # code (its only wait the agreement's), each returned with the tensor it reads (alive until the flush)
        assert [int(n) for n in shapes] == [r["bucket_numels"][b] // 2 for b in early]
        assert code.count("wait_tensor.default(") == code.count("all_gather_into_tensor.default(")
        returned = re.findall(r"return \((.*)\)", code.split("def call(")[1])[0]
        assert all(out in returned and inp in returned for out, inp in issued) and len(issued) == len(early)


@pytest.mark.parametrize("name", list(CASES))
def test_option_and_layout_train_like_one_process(name, eager_runs):
    assert_like_one_process(CASES[name], eager_runs[name])


@pytest.mark.parametrize("name", list(INDUCTOR))
def test_under_inductor_trains_like_one_process(name, inductor_runs):  # tests/conftest.py: shared
    assert_like_one_process(INDUCTOR[name], inductor_runs[name])
