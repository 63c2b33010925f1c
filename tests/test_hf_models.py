"""Unmodified Hugging Face causal LMs train under pp=2 x dp=2 x cp=2 (8 gloo processes) like one process.

Tiny random configs built here, no weights downloaded. GPT-2 (tied embeddings,
learned positions) runs GPipe, Llama (RoPE, GQA, tie_word_embeddings) runs 1F1B;
both through torch.distributed.pipelining's schedules.
"""
import transformers  # noqa: F401 - the `test` extra installs it; missing, these tests must fail

from gradsched.launch import run_ranks
from tied_training import Job, compare, rank_main, reference

TOL = 1e-5


def train_8_ranks(model: str, schedule: str):
    job = Job(model=model, pp=2, dp=2, cp=2, steps=5, global_batch=8, schedule=schedule,
              options={"compiler": "eager", "microbatches": 2})
    ranks = run_ranks(rank_main, job.world, job, timeout_s=600)
    return reference(job), ranks


def assert_trains_like_one_process(ref, ranks):
    cmp = compare(ref, ranks)
    assert cmp["uncovered"] == [] and cmp["max_abs_diff"] < TOL and cmp["tied_bitwise_equal"]
    last = [r for r in ranks if r["losses"][0] is not None]
    for step, want in enumerate(ref["losses"]):
        got = sum(r["losses"][step] for r in last) / len(last)
        assert abs(got - want) <= TOL * abs(want), (step, got, want)


def test_gpt2_with_gpipe_matches_one_process_and_its_tie_is_found():
    ref, ranks = train_8_ranks("hf_gpt2", "gpipe")
    assert_trains_like_one_process(ref, ranks)
    assert ranks[0]["ties"] == [((0, "model.transformer.wte.weight"), (1, "model.lm_head.weight"))]


def test_llama_with_1f1b_matches_one_process_and_its_tie_is_found():
    ref, ranks = train_8_ranks("hf_llama", "1f1b")
    assert_trains_like_one_process(ref, ranks)
    assert ranks[0]["ties"] == [((0, "model.model.embed_tokens.weight"), (1, "model.lm_head.weight"))]
