"""gradsched.parallelize over tp (x dp) trains the model one float64 process trains.

Each job builds the unmodified model (our tiny GPT, Hugging Face Llama with GQA, Qwen2, GPT-2), parallelizes it
with a plan of tp ranks (times dp, or times pp under 1F1B and ZB-V), and trains two AdamW steps: its losses, its step-1 reduced gradients (a TP
shard's against the same chunk of the whole gradient, a bucket shard's against its elements), its clipping norms
and its parameters after the steps are compared with the unsplit model in one float64 process on the global
batch. Every job runs on one set of 4 processes.
"""
import math

import pytest
import torch

from gradsched.launch import run_ranks
from tied_training import abs_diff
from tp_training_fns import (Job, gradient_error, reference, reference_distance, refused_in_the_last_stage, resume_main,
                             training_jobs)

EXACT = 1e-12
PP2 = ("model.blocks.1",)
ZBV = ("model.blocks.0", "model.blocks.1", "model.ln_f")  # the V's four stages of the two-block GPT
JOBS = {
    "tiny_gpt-tp2xdp2-all_reduce-clipped": Job(tp=2, dp=2, shard=False, clip=0.5),
    "tiny_gpt-tp2xdp2-shard-inductor": Job(tp=2, dp=2, shard=True, compiler="inductor"),
    "tiny_gpt-tp2xdp2-params-inductor-clipped": Job(tp=2, dp=2, shard="params", clip=0.5, compiler="inductor"),
    "tiny_gpt-tp4-inductor-clipped": Job(tp=4, compiler="inductor", clip=0.5),
    "hf_llama-tp4-gqa-inductor": Job(model="hf_llama", tp=4, compiler="inductor"),
    "gradsched_llama-tp4-enable_gqa": Job(model="gradsched_llama", tp=4),
    "hf_gpt2-tp2xdp2-shard-inductor": Job(model="hf_gpt2", tp=2, dp=2, shard=True, compiler="inductor"),
    "hf_qwen2-tp2xdp2-params": Job(model="hf_qwen2", tp=2, dp=2, shard="params"),
    "tiny_gpt-tp2xpp2-1f1b": Job(tp=2, pp=2, microbatches=2, split=PP2),
    "tiny_gpt-tp2xpp2-zbv-inductor-clipped": Job(tp=2, pp=2, schedule="zbv", microbatches=4, split=ZBV, clip=0.5,
                                                 compiler="inductor"),
    "tiny_gpt-tp2xpp2-1f1b-shard-inductor-clipped": Job(tp=2, pp=2, microbatches=2, split=PP2, shard=True,
                                                       compiler="inductor", clip=0.5),
    # micro-batches at pp 1 with padded labels (a dp rank's micro-batch labels nothing), and a looped schedule
    "tiny_gpt-tp2xdp2-padded-m2-shard-clipped": Job(tp=2, dp=2, microbatches=2, shard=True, labels="padded", clip=0.5),
    "tiny_gpt-tp2xpp2-interleaved_1f1b": Job(tp=2, pp=2, schedule="interleaved_1f1b", microbatches=4, split=ZBV),
    # ZeRO-3 in a V (several stages a rank: each stage graph lays out its own buckets of TP shards)
    "tiny_gpt-tp2xpp2-zbv-params-clipped": Job(tp=2, pp=2, schedule="zbv", microbatches=4, split=ZBV, shard="params",
                                               clip=0.5),
    "hf_gpt2-tp2xpp2-params": Job(model="hf_gpt2", tp=2, pp=2, microbatches=2, split=("model.transformer.h.1",),
                                  shard="params"),
    "hf_qwen2-tp2xpp2-zbv-embedding_stage": Job(model="hf_qwen2", tp=2, pp=2, schedule="zbv", microbatches=4, split=(
        "model.model.layers.0", "model.model.layers.1", "model.model.norm"), shard=True, clip=0.5),  # stage 0: the embedding alone
    "hf_llama-tp2xpp2-1f1b": Job(model="hf_llama", tp=2, pp=2, microbatches=2, split=("model.model.layers.1",)),
    # context parallelism over each TP rank's heads: the ring (its fp32-or-wider sums) and Ulysses
    "tiny_gpt-tp2xcp2-ring-shard-inductor": Job(tp=2, cp=2, shard=True, compiler="inductor"),
    "tiny_gpt-tp2xcp2-ulysses-params-inductor-clipped": Job(tp=2, cp=2, shard="params", clip=0.5, compiler="inductor",
                                                            options={"comm": "a2a"}),
    "gradsched_llama-tp2xcp2-ring-inductor": Job(model="gradsched_llama", tp=2, cp=2, compiler="inductor"),
    "gradsched_gpt2-tp2xcp2-ulysses": Job(model="gradsched_gpt2", tp=2, cp=2, options={"comm": "a2a"}),
    # each layout above on every model of the issue (tiny GPT, HF Llama with GQA, HF GPT-2), and each layout under
    # both compilers (Inductor on the tiny GPT where it can: an HF model's cold compile costs the suite most)
    "hf_llama-tp2xpp2-zbv": Job(model="hf_llama", tp=2, pp=2, schedule="zbv", microbatches=4, split=(
        "model.model.layers.0", "model.model.layers.1", "model.model.norm")),
    "hf_gpt2-tp2xpp2-zbv": Job(model="hf_gpt2", tp=2, pp=2, schedule="zbv", microbatches=4, split=(
        "model.transformer.h.0", "model.transformer.h.1", "model.transformer.ln_f")),
    "hf_llama-tp2xdp2-shard": Job(model="hf_llama", tp=2, dp=2, shard=True),
    "hf_llama-tp2xdp2-params": Job(model="hf_llama", tp=2, dp=2, shard="params"),
    "hf_gpt2-tp2xdp2-params": Job(model="hf_gpt2", tp=2, dp=2, shard="params"),
    "gradsched_gpt2-tp2xcp2-ring": Job(model="gradsched_gpt2", tp=2, cp=2),
    "gradsched_llama-tp2xcp2-ulysses": Job(model="gradsched_llama", tp=2, cp=2, options={"comm": "a2a"}),
    # a user's override by module name: the MLPs whole on every TP rank, attention still split
    "tiny_gpt-tp2xdp2-mlp_whole_by_tp_plan": Job(tp=2, dp=2, options={"tp_plan": {"model.blocks.*.fc": "replicated",
                                                                                  "model.blocks.*.out": "replicated"}}),
    "tiny_gpt-tp2xdp2-replicas_checked": Job(tp=2, dp=2, options={"check_tp_replicas": True}),
    "tiny_gpt-tp2xdp2-replica_nudged": Job(tp=2, dp=2, options={"check_tp_replicas": True},
                                           perturb="model.ln_f.weight"),
}
TRAINED = [k for k, j in JOBS.items() if not j.perturb]


def number_diff(a: float, b: float) -> float:
    """|a - b|, inf when either is not finite (a NaN compares false to every bound)."""
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


@pytest.fixture(scope="module")
def ranks():
    out = run_ranks(training_jobs, 4, list(JOBS.values()), timeout_s=1500)
    return {name: [r[i] for r in out] for i, name in enumerate(JOBS)}


def one_process(job: Job, compiled: bool, runs: dict) -> dict:
    """reference(job, compiled), run once for every job it is the same run of (model, data, steps, clipping)."""
    key = (job.model, job.global_batch, job.steps, job.clip, job.labels, compiled)
    if key not in runs:
        runs[key] = reference(job, compiled=compiled)
    return runs[key]


@pytest.fixture(scope="module")
def one_process_runs():
    return {}


@pytest.fixture(scope="module")
def references(one_process_runs):
    return {name: one_process(JOBS[name], False, one_process_runs) for name in TRAINED}


@pytest.fixture(scope="module")
def bounds(references, one_process_runs):
    """How close each job must come to its float64 reference. EXACT, unless the model computes in float32 itself
    (Hugging Face's Llama and Qwen2 upcast their norms and rotary embeddings to float32) and the job runs
    Inductor, whose float32 kernels round differently from eager's (cos 6e-8 apart): then twice as far as the
    unsplit model under Inductor in one process is from it, per quantity: one such rounding on each side."""
    out = {}
    for name in TRAINED:
        job, own = JOBS[name], {k: 0.0 for k in ("losses", "grads", "state", "norms")}
        if job.compiler == "inductor":
            own = reference_distance(one_process(job, True, one_process_runs), references[name])
            # a NaN or inf there would make every bound infinite: a test that cannot fail
            assert all(math.isfinite(v) for v in own.values()), (name, own)
        out[name] = {k: max(EXACT, 2 * v) for k, v in own.items()}
    return out


@pytest.mark.parametrize("name", TRAINED)
def test_losses_and_step1_gradients_equal_one_float64_process(ranks, references, bounds, name):
    ref, job, bound = references[name], JOBS[name], bounds[name]
    # the ranks that hold the pipeline's last stage report the loss (every rank at pp 1)
    reported = [r for r in ranks[name] if r["losses"] != [None] * job.steps]
    assert len(reported) == job.tp * job.dp * job.cp, [r["losses"] for r in ranks[name]]
    for r in reported:
        assert len(r["losses"]) == job.steps
        for got, want in zip(r["losses"], ref["losses"]):
            assert number_diff(got, want) < bound["losses"], (name, r["losses"], ref["losses"])
    assert gradient_error(ref, ranks[name], job.tp) < bound["grads"], (name, bound)


@pytest.mark.parametrize("name", TRAINED)
def test_parameters_after_the_steps_equal_one_float64_process(ranks, references, bounds, name):
    """Every rank's whole parameters (TP shards gathered) after two AdamW steps; float64 masters in every shard
    mode, so no fp32 rounding."""
    ref = references[name]
    for r in ranks[name]:
        assert set(r["state"]) == set(ref["state"])
        worst = max(abs_diff(r["state"][k], v) for k, v in ref["state"].items())
        assert worst < bounds[name]["state"], (name, worst, bounds[name])


@pytest.mark.parametrize("name", [k for k in TRAINED if JOBS[k].clip])
def test_clipping_counts_each_tp_shard_and_each_replicated_parameter_once(ranks, references, bounds, name):
    ref, bound = references[name]["norms"], bounds[name]["norms"]
    for r in ranks[name]:
        assert len(r["norms"]) == len(ref)
        assert all(number_diff(a, b) < bound for a, b in zip(r["norms"], ref)), (r["norms"], ref)


@pytest.mark.parametrize("name", TRAINED)
def test_no_rank_holds_a_tp_sharded_matrix_whole(ranks, name):
    for r in ranks[name]:
        assert r["partitions"], "no parameter was sharded over TP"
        assert r["held_bytes"] == r["replicated_bytes"], r["held_bytes"]
        sharded = sum(1 for dim, _ in r["partitions"].values() if dim is not None)
        assert sharded and r["trained_numel"] < r["whole_numel"], (r["trained_numel"], r["whole_numel"])
        # (a tie on one rank, as a V's first and last stage, is proved in each graph that reads it)
        assert {n for n, _ in r["proved"]} == set(r["names"]), "not every gradient's TP reduction proved"


# a V holds both ends of its tie on one rank, as one Parameter: only a 1F1B split has copies on two ranks
@pytest.mark.parametrize("name", [k for k in TRAINED if JOBS[k].pp > 1 and JOBS[k].schedule == "1f1b"])
def test_tied_copies_on_different_stages_stay_bitwise_equal_on_every_tp_rank(ranks, name):
    """After the steps, each stage's copy of a tie (its TP shards, trained on their own ranks) holds the same bits
    as every other stage's copy on the same dp and cp index: the tie's all-reduce ran over each TP rank's shard."""
    compared = 0
    for r in ranks[name]:
        for members in r["ties"]:
            mine = dict(members).get(r["stage"])
            for o in ranks[name]:
                theirs = dict(members).get(o["stage"])
                if o["stage"] != r["stage"] and (o["dp_idx"], o["cp_idx"]) == (r["dp_idx"], r["cp_idx"]) \
                        and mine in r["tied_state"] and theirs in o["tied_state"]:
                    assert torch.equal(r["tied_state"][mine], o["tied_state"][theirs]), (name, mine, theirs)
                    compared += 1
    assert compared, f"{name}: no tie across ranks was compared"


@pytest.mark.parametrize("name", [k for k in TRAINED if JOBS[k].pp > 1])
def test_the_last_stage_hands_its_loss_the_logits_split_over_the_vocabulary(ranks, name):
    """Loss parallel across pipeline stages: the last stage's graph leaves its LM head's logits as each TP rank's
    columns, and the loss after it (gradsched.training.vocab_parallel_loss) never gathers them (its exact
    losses and gradients are the test above)."""
    last = [r for r in ranks[name] if r["losses"] != [None] * JOBS[name].steps]
    assert last
    for r in last:
        assert r["loss_logits"], f"{name}: the loss read gathered logits"
        assert all(shape[-1] * JOBS[name].tp in r["vocab"] for shape in r["loss_logits"]), (r["loss_logits"], r["vocab"])


def test_a_torch_optimizer_built_before_the_shards_are_cut_is_refused_at_its_step(ranks):
    # built over model.parameters() before the first step, it holds the whole Parameters, which get no gradient
    refused = [(name, r["plain_refused"]) for name in TRAINED for r in ranks[name] if r["partitions"]]
    assert refused and all(why is not None and "no longer trains" in why and "tensor-parallel shard" in why
                           for _, why in refused), refused


def test_the_tp_ranks_of_a_stage_shard_the_same_parameters_along_the_same_dims(ranks):
    for name in TRAINED:
        for stage in {r["stage"] for r in ranks[name]}:
            held = [r["partitions"] for r in ranks[name] if r["stage"] == stage]
            assert held[0] and all(p == held[0] for p in held), (name, stage)


HEADS = {"tiny_gpt": (4, 4), "gradsched_llama": (4, 2), "gradsched_gpt2": (4, 4)}  # (query, key/value heads)


@pytest.mark.parametrize("name", [k for k in TRAINED if JOBS[k].cp > 1])
def test_context_parallelism_runs_each_tp_ranks_heads_over_its_cp_group(ranks, name):
    """Heads split over tp first: every attention call was lowered, with the scheme asked for, over 1/tp of the
    model's query heads and of its key/value heads."""
    job = JOBS[name]
    q, kv = HEADS[job.model]
    scheme = job.options.get("comm", "ring")
    for r in ranks[name]:
        assert r["lowered"] and all(c == (scheme, q // job.tp, kv // job.tp) for c in r["lowered"]), r["lowered"]


def test_check_tp_replicas_names_a_replicated_parameter_one_tp_rank_changed(ranks):
    """Rank (tp 1) nudged model.ln_f.weight before the last step: every rank of both TP groups stops at the
    step, naming it (each group gathered the same bytes, so no rank goes on alone)."""
    for r in ranks["tiny_gpt-tp2xdp2-replica_nudged"]:
        assert "diverged" in r, r.keys()
        assert "'model.ln_f.weight'" in r["diverged"] and "after step 2" in r["diverged"], r["diverged"]


def test_check_tp_replicas_passes_a_run_whose_replicas_are_equal(ranks):
    assert all("diverged" not in r for r in ranks["tiny_gpt-tp2xdp2-replicas_checked"])
    assert all(math.isfinite(x) for r in ranks["tiny_gpt-tp2xdp2-replicas_checked"] for x in r["losses"])


# ---- checkpoints: saved at tp2 x pp2, resumed at other layouts -----------------------------------

SAVED = Job(tp=2, pp=2, microbatches=2, split=PP2, shard=True)
RESUMED = {"tp1": Job(tp=1), "tp4": Job(tp=4), "tp2xdp2-params": Job(tp=2, dp=2, shard="params")}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Two steps at tp2 x pp2 then a save; each other layout loads it and takes the third step."""
    where = str(tmp_path_factory.mktemp("tp_checkpoint"))
    saved = run_ranks(resume_main, 4, SAVED, where, "", 2, timeout_s=600)
    return saved, {name: run_ranks(resume_main, job.tp * job.dp * job.pp, job, "", where, 3, timeout_s=600)
                   for name, job in RESUMED.items()}


@pytest.mark.parametrize("name", RESUMED)
def test_a_checkpoint_saved_at_tp2_x_pp2_resumes_at_another_layout_as_one_float64_process_goes_on(resumed, name):
    """The third step's loss and every parameter after it (AdamW's moments read back for the new layout) equal
    one float64 process trained three steps."""
    saved, runs = resumed
    ref = reference(Job(steps=3))
    assert [r["losses"] for r in saved if r["losses"][0] is not None] == [pytest.approx(ref["losses"][:2], abs=EXACT)] * 2
    for r in runs[name]:
        assert r["start"] == 2 and number_diff(r["losses"][0], ref["losses"][2]) < EXACT, (r["losses"], ref["losses"])
        worst = max(abs_diff(r["state"][k], v) for k, v in ref["state"].items())
        assert worst < EXACT, worst


def test_a_refusal_in_a_later_stage_names_the_models_line_on_every_rank():
    """The pass refuses an op of the last stage only (a mean over the sequence): its ranks raise the refusal with
    the model's own line, not the stage graph's generated code, and the first stage's ranks, left waiting, are
    told it by their peers."""
    said = run_ranks(refused_in_the_last_stage, 4, timeout_s=300)
    for rank, text in enumerate(said):
        assert "TensorParallelError" in text and "x - x.mean(1, keepdim=True)" in text, (rank, text)
        assert "eval_with_key" not in text.split("x.mean(1")[0], (rank, text)


def test_tp_plan_keeps_the_modules_it_names_whole_and_the_pass_splits_the_rest(ranks):
    """tp_plan={"model.blocks.*.fc": "replicated", ...}: those weights whole on every TP rank (their gradients summed
    over TP, proved), the attention found and split as without a plan; trained as one process (the tests above)."""
    for r in ranks["tiny_gpt-tp2xdp2-mlp_whole_by_tp_plan"]:
        how = dict(r["proved"])
        mlp = {n: h for n, h in how.items() if ".fc." in n or ".out." in n}
        assert len(mlp) == 8 and set(mlp.values()) == {"summed once"}, mlp  # 2 blocks x (fc, out) x (weight, bias)
        assert not any(".fc." in n or ".out." in n for n in r["partitions"]), r["partitions"]  # no TP shard of them
        split = {n for n in r["partitions"] if ".qkv." in n or ".proj." in n}
        assert split == {f"model.blocks.{i}.{m}.weight" for i in (0, 1) for m in ("qkv", "proj")}, split
