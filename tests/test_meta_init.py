"""A model built on the meta device trains like the same model built whole in one process, and no rank
allocates more than its own stage (gradsched.training.materialize)."""
import pytest
import torch

import gradsched
from gradsched.launch import run_ranks
from gradsched.training.materialize import first_names, initialize
from rank_fns import build_on_meta, init_tiny_gpt, meta_built_training, meta_model_without_init
from tied_training import abs_diff
from tiny_gpt import TinyGPT, lm_loss, make_batch


def one_process(steps: int = 2, model_name: str = "tiny_gpt") -> dict:
    """The unsplit model, built whole on the CPU and initialized tensor by tensor as gradsched does, trained on
    the global batch."""
    from gradsched.hf import tiny_llama
    model = TinyGPT() if model_name == "tiny_gpt" else tiny_llama()[0]  # built whole, for real
    initialize(model, build_on_meta(model_name)[2], first_names(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        x, y = make_batch(8, TinyGPT().config, seed=1 + step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def reference():
    return one_process()


ZBV = {"schedule": "zbv", "microbatches": 4, "split_points": ["blocks.0", "blocks.1", "ln_f"]}


@pytest.mark.parametrize("shard", [True, "params"])
def test_a_meta_built_model_trains_at_pp2_dp2_like_the_whole_model_in_one_process(reference, shard, tmp_path):
    # shard=True trains in a V (rank 0 holds the embedding's stage and the head's: the tie one Parameter,
    # allocated once) and is loaded under 1F1B below; shard="params" trains under 1F1B
    ranks = run_ranks(meta_built_training, 4, 2, {"shard": shard} | (ZBV if shard is True else {}), 2, str(tmp_path))
    # allocated without a step and loaded (pp2 x dp2, and pp1 x dp4: another layout), it holds what was saved
    for r in run_ranks(meta_built_training, 4, 2 if shard is True else 1, {"shard": shard}, 0, "", str(tmp_path)):
        assert max(abs_diff(r["state"][k], v) for k, v in reference.items()) < 1e-5
    for r in ranks:
        assert list(r["state"]) == list(reference)
        assert max(abs_diff(r["state"][k], v) for k, v in reference.items()) < 1e-5
        # this rank allocated its stage's parameters only; the unsplit model stays on meta
        assert r["meta_trained"] == [] and r["unsplit_real"] == []
        other = "blocks.1." if r["stage"] == 0 else "blocks.0."
        if shard is True:  # the V: rank 0 holds the embeddings and ln_f with the head, rank 1 both blocks
            other = "blocks." if r["stage"] == 0 else "wte."
        assert r["trained"] and not any(n.startswith(other) for n in r["trained"]), r["trained"]


def test_a_meta_built_hugging_face_llama_trains_at_pp2_dp2_like_the_whole_model_in_one_process():
    # its split graphs make positions and check devices inside export's submodules; its rotary table is a buffer
    reference = one_process(model_name="hf_llama")
    for r in run_ranks(meta_built_training, 4, 2, {}, 2, "", "", "hf_llama"):
        assert max(abs_diff(r["state"][k], v) for k, v in reference.items()) < 1e-5


def test_an_init_that_leaves_a_buffer_unwritten_is_refused_on_every_rank_before_any_step():
    ranks = run_ranks(meta_built_training, 4, 2, {}, 1, "", "", "hf_llama_params_only_init")
    for r in ranks:  # stage 0 holds the rotary table; stage 1 is told, instead of waiting for stage 0's activations
        assert ("init_weights('model.model.rotary_emb.inv_freq', tensor) left elements of the tensor unwritten"
                if r["stage"] == 0 else "could not allocate or initialize its part") in r["refused"], r


def test_a_meta_built_model_trains_at_dp2_like_the_whole_model_in_one_process(reference, tmp_path):
    for r in run_ranks(meta_built_training, 2, 1, {}, 2, str(tmp_path)):
        assert max(abs_diff(r["state"][k], v) for k, v in reference.items()) < 1e-5
        assert r["meta_trained"] == []
        # a torch optimizer built over the meta Parameters would step nothing: refused, saying when to build it
        assert "no longer trains" in r["plain_refused"] and "after the first train_step" in r["plain_refused"]
        # a checkpoint saved (or loaded) before the first step would hold (or fill) nothing
        assert "is still on the meta device" in r["refused"] and "model.allocate(inputs, targets)" in r["refused"]


def test_every_tensor_gets_the_values_of_its_name_whatever_else_is_initialized():
    whole = TinyGPT()
    initialize(whole, init_tiny_gpt, first_names(whole))
    block = TinyGPT().blocks[1]  # alone, as a stage would hold it, named as in the unsplit model
    initialize(block, init_tiny_gpt, {f"{n}": f"blocks.1.{n}" for n, _ in block.named_parameters()})
    for n, p in block.named_parameters():
        assert torch.equal(p, whole.get_parameter(f"blocks.1.{n}")), n
    assert whole.wte.weight is whole.lm_head.weight  # one tensor, one name, one value


def test_a_tensor_the_model_does_not_name_is_refused_rather_than_given_arbitrary_values():
    stage = TinyGPT().blocks[0]
    stage.register_buffer("_tensor_constant0", torch.ones(3))  # as a split may keep a constant made in forward
    names = {n: f"blocks.0.{n}" for n, _ in stage.named_parameters()}
    with pytest.raises(ValueError, match="holds a tensor '_tensor_constant0' that the model does not name"):
        initialize(stage, init_tiny_gpt, names)


def test_initialize_on_a_model_still_on_meta_says_to_allocate_first():
    with torch.device("meta"):
        model = TinyGPT()
    with pytest.raises(ValueError, match=r"'wte.weight' \(and \d+ more\) is still on the meta device: allocate "
                                         r"first \(module.to_empty"):
        initialize(model, init_tiny_gpt, first_names(model))


def test_a_meta_model_without_init_weights_is_refused_at_its_first_step_naming_what_to_pass():
    # accepted by parallelize (the dry run trains it on meta inputs), refused before the first step's collectives
    [message] = run_ranks(meta_model_without_init, 1)
    assert "is on the meta device (shapes, no values) and the inputs on cpu: pass parallelize(..., init_weights=fn" \
        in message


def test_init_weights_for_a_model_that_already_holds_values_is_refused():
    with pytest.raises(ValueError, match="already hold values"):
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(pp=1, dp=1), loss_fn=lm_loss,
                              init_weights=init_tiny_gpt)


def test_a_model_partly_on_meta_is_refused():
    model = TinyGPT()
    model.blocks[0].qkv.to_empty(device="meta")
    with pytest.raises(ValueError, match="are on the meta device and the rest are not"):
        gradsched.parallelize(model, plan=gradsched.ParallelPlan(pp=1, dp=1), loss_fn=lm_loss,
                              init_weights=init_tiny_gpt)


def test_a_meta_model_compiled_by_backend_name_is_refused_pointing_to_parallelize():
    torch._dynamo.reset()
    with torch.device("meta"):
        model = TinyGPT()
    compiled = torch.compile(model, backend="gradsched", fullgraph=True,
                             options={"plan": gradsched.ParallelPlan(pp=1, dp=1)})
    with pytest.raises(Exception, match="is on the meta device, with no values to train.*init_weights"):
        compiled(torch.zeros(2, 16, dtype=torch.long, device="meta"))
