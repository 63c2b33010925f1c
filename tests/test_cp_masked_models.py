"""Hugging Face models with sliding windows, packed documents and padding train under context
parallelism exactly as in one process.

Each case trains a tiny tied HF model (sequence 64, window 16) on 4 gloo processes and compares,
against the unsplit model in one process under HF's own SDPA attention (HF builds its own window,
packed-document and padding masks: nothing of gradsched's mask code is in the reference), the
first step's reduced gradients, every step's loss and every parameter (SGD: the update is the
gradient, so scale errors show), as tests/test_option_matrix.py does.
"""
import pytest

from test_option_matrix import assert_like_one_process, run_jobs
from tied_training import Job
from tiny_gpt import GPTConfig


def job(model, pp, dp, cp, inputs="", **options):
    return Job(pp=pp, dp=dp, cp=cp, steps=2, optimizer="sgd", lr=0.5, labels="full", model=model, inputs=inputs,
               config=GPTConfig(seq=64), options={"compiler": "eager", **options})


CASES = {
    # (documents under all-to-all: the hybrid below, and the balanced pp2 x cp2 case; a data-parallel axis beside CP:
    # the balanced Llama ring and the checkpointed cases of tests/test_cp_checkpointing.py)
    "mistral_window16_cp4_auto": job("hf_mistral", 1, 1, 4, comm="auto"),  # a mask: auto keeps the ring
    # all-to-all over CP ranks {0,1}, {2,3} x ring over {0,2}, {1,3}, with the window and documents (the
    # 8-rank case below runs it under a pipeline)
    "qwen2_window16_packed_documents_cp4_hybrid": job("hf_qwen2", 1, 1, 4, inputs="documents", comm="hybrid",
                                                      a2a_degree=2),
    # pipeline stages: positions reach the second stage's attention as a computed value, the padding mask handed to
    # an unchanged call per stage; local and global layers in different stages, under the ring (Qwen2 at pp2 under
    # all-to-all: tests/test_cp_checkpointing.py)
    "gemma3_local_and_global_right_padding_pp2_cp2_m2": job("hf_gemma3", 2, 1, 2, inputs="padding", microbatches=2),
    # load_balance="documents": every row reordered so each rank holds a piece of every document, which the
    # model is told as seq_idx (the window then measured on positions)
    "llama_packed_documents_balanced_dp2_cp2": job("hf_llama_documents", 1, 2, 2, inputs="documents",
                                                   load_balance="documents"),
    "mistral_window16_packed_documents_balanced_pp2_cp2_m2_a2a": job("hf_mistral", 2, 1, 2, inputs="documents",
                                                                     load_balance="documents", microbatches=2,
                                                                     comm="a2a"),
    # (balanced documents under the hybrid: tests/test_masked_attention.py against fp64, eager and Inductor)
    # Gemma's graphs under shard="params": a bucket's first use gives several tensors (its gathers crashed the
    # compile before)
    "gemma_pp2_dp2_params_m2": job("hf_gemma", 2, 2, 1, shard="params", microbatches=2),
}

# 8 ranks: the pipeline's two stages each run their own hybrid (all-to-all groups {0,1}, {2,3} x ring groups
# {0,2}, {1,3} of the stage's CP ranks), created by that stage's ranks alone
EIGHT_RANKS = {
    "mistral_window16_packed_documents_pp2_cp4_m2_hybrid": job("hf_mistral", 2, 1, 4, inputs="documents",
                                                               microbatches=2, comm="hybrid", a2a_degree=2),
}


@pytest.fixture(scope="module")
def eager_runs():
    return run_jobs(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_masked_model_trains_like_one_process(name, eager_runs):
    assert_like_one_process(CASES[name], eager_runs[name])


@pytest.fixture(scope="module")
def eight_rank_runs():
    return run_jobs(EIGHT_RANKS, world=8)


@pytest.mark.parametrize("name", list(EIGHT_RANKS))
def test_masked_model_on_eight_ranks_trains_like_one_process(name, eight_rank_runs):
    assert_like_one_process(EIGHT_RANKS[name], eight_rank_runs[name])
    for r in eight_rank_runs[name]:  # each stage lowered its own layers' calls to the hybrid
        assert "hybrid (a2a over 2 x ring over 2), window 16" in r["report"]


def test_the_schedule_report_names_each_attention_calls_scheme_and_ring_steps(eager_runs):
    # window 16 at S=64, cp=4: chunks of 8, so a query chunk reads its own and the two before it; rank 0
    # (chunks 0 and 7) needs chunk 5 of rank 2: every step is needed. (tests/test_masked_attention.py
    # has a window shorter than a chunk, and the steps it skips.)
    auto = eager_runs["mistral_window16_cp4_auto"][0]["report"]
    assert "context parallel (cp=4): 2 attention call(s) lowered" in auto
    assert "ring, window 16, ring steps [0, 1, 2, 3] of 4 -- a causal mask: the ring skips" in auto
    hybrid = eager_runs["qwen2_window16_packed_documents_cp4_hybrid"][0]["report"]
    assert "hybrid (a2a over 2 x ring over 2), window 16, ring steps [0, 1] of 2" in hybrid
    balanced = eager_runs["llama_packed_documents_balanced_dp2_cp2"][0]["report"]
    assert "ring, documents balanced over the ranks, ring steps [0, 1] of 2" in balanced
