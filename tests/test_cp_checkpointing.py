"""Activation checkpointing under context parallelism trains exactly as in one process.

Dynamo puts a checkpointed layer (HF's gradient_checkpointing_enable, torch.utils.checkpoint with
either use_reentrant, a selective context_fn policy) in a subgraph; its attention must become the
ring there too, and the backward's recomputation must recompute the ring. Left local, each rank
would attend over its own slice only: the loss was 1.5e-3 relative off with no error.

Each case trains on 4 gloo processes and compares, against the unsplit model in one process (HF's
own SDPA attention, checkpointed the same way), the first step's reduced gradients, every loss and
every parameter (SGD: the update is the gradient), as tests/test_option_matrix.py does.
"""
import pytest

from test_option_matrix import assert_like_one_process, run_jobs
from tied_training import Job
from tiny_gpt import GPTConfig


def job(model, pp, dp, cp, checkpointing, inputs="", labels="full", layers=2, **options):
    seq = 16 if model == "tiny_gpt" else 64  # Qwen2's window 16 then hides keys
    return Job(pp=pp, dp=dp, cp=cp, steps=2, optimizer="sgd", lr=0.5, model=model, checkpointing=checkpointing,
               inputs=inputs, labels=labels, config=GPTConfig(seq=seq, layers=layers),
               options={"compiler": "eager", **options})


CASES = {  # Llama, Qwen2 and Mistral (windows), eager and Inductor, ring and a2a, dp2 x cp2 and pp2 x cp2, sharded
    # parameters
    # the recomputation reads the parameters again: under shard="params" the backward gathers them for it
    "hf_llama_non_reentrant_dp2_cp2_params": job("hf_llama", 1, 2, 2, "non_reentrant", shard="params"),
    # pipelining's trace drops the checkpoint: gradsched puts it back on the stage's layers
    "hf_qwen2_window_reentrant_pp2_cp2_m2_a2a": job("hf_qwen2", 2, 1, 2, "reentrant", microbatches=2, comm="a2a"),
    # the user's own torch.utils.checkpoint around each block, with a policy that recomputes attention (eager:
    # Inductor's part of a checkpointed ring is the Qwen2 row's)
    "tiny_gpt_selective_dp2_cp2": job("tiny_gpt", 1, 2, 2, "selective"),
}


# Inductor: Mistral's window over packed documents, balanced (each rank a piece of every document), with the
# checkpointed layers' ring recomputed: one cold compile for both (tests/test_cp_masked_models.py), of one layer (a
# second compiles the same kernels again), on two ranks (four compiled it twice as slowly: 77 s against 56 s)
TWO_RANKS = {
    "inductor_hf_mistral_window_documents_balanced_non_reentrant_cp2": job(
        "hf_mistral", 1, 1, 2, "non_reentrant", inputs="documents", load_balance="documents", layers=1,
        compiler="inductor"),
}


@pytest.fixture(scope="module")
def runs():
    return {**run_jobs(CASES), **run_jobs(TWO_RANKS, world=2)}


@pytest.mark.parametrize("name", list(CASES) + list(TWO_RANKS))
def test_checkpointed_model_under_cp_trains_like_one_process(name, runs):
    assert_like_one_process({**CASES, **TWO_RANKS}[name], runs[name])


def test_the_report_says_the_ring_runs_inside_an_activation_checkpoint(runs):
    report = runs["hf_llama_non_reentrant_dp2_cp2_params"][0]["report"]
    assert report.count("ring, inside an activation checkpoint, ring steps [0, 1] of 2") == 2


def test_each_pipeline_stage_checkpoints_its_own_layers_again(runs):
    for r in runs["hf_qwen2_window_reentrant_pp2_cp2_m2_a2a"]:  # one layer per stage
        assert r["report"].count("a2a, window 16, inside an activation checkpoint") == 1, r["report"]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "selective"])
def test_a_pipeline_stage_gets_back_the_checkpoints_its_trace_ran_as_plain_calls(mode):
    import torch
    import torch.utils.checkpoint as ckpt
    from torch.distributed.pipelining import SplitPoint, pipeline
    from gradsched.training.pipeline_split import checkpoint_stage_modules, checkpointed_calls
    from tiny_gpt import TinyGPT
    before = ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator
    model, x = TinyGPT(GPTConfig(checkpoint=mode)), torch.zeros(1, 16, dtype=torch.long)
    with torch.no_grad(), checkpointed_calls() as calls:
        pipe = pipeline(model, mb_args=(x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    assert [f for f, _ in calls] == list(model.blocks)  # torch's functions are put back afterwards
    assert (ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator) == before
    stage = pipe.get_stage_module(0)
    names = [n for n, _ in stage.named_parameters()]
    assert checkpoint_stage_modules(stage, model, calls) == []
    assert [n for n, _ in stage.named_parameters()] == names
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    torch.compile(stage, backend=capture)(x)
    assert [str(n.target) for n in graphs[0].graph.nodes if "checkpoint" in str(n.target)] == \
        ["tag_activation_checkpoint"]  # blocks.0, the first stage's one block


def test_a_checkpointed_function_that_is_no_modules_call_is_reported_lost():
    import torch
    from gradsched.training.pipeline_split import checkpoint_stage_modules, checkpointed_calls
    from tiny_gpt import TinyGPT
    model = TinyGPT(GPTConfig())

    def closure(x):
        return model.blocks[0](x) * 2
    with checkpointed_calls() as calls:
        torch.utils.checkpoint.checkpoint(closure, torch.zeros(1, 4, 32), use_reentrant=False)
    assert checkpoint_stage_modules(model, model, calls) == [closure]
