"""Training under context parallelism matches the unsplit model in one process (fp32)."""
from gradsched.launch import run_ranks
from tied_training import Job, compare, gradient_error, rank_main, reference

from rank_fns import hand_written_attention_under_cp, padded_sequence_under_cp


def assert_matches(job, ranks):
    ref = reference(job)
    cmp = compare(ref, ranks)
    assert cmp["max_abs_diff"] < 1e-5 and cmp["uncovered"] == [] and cmp["tied_bitwise_equal"]
    last = [r for r in ranks if r["losses"][0] is not None]
    for step, want in enumerate(ref["losses"]):
        assert abs(sum(r["losses"][step] for r in last) / len(last) - want) <= 1e-5 * abs(want)


def test_the_ring_compiled_by_inductor_holds_its_block_kernels_and_hand_offs(inductor_runs):
    """The option matrix's pp2 x cp2 Inductor row (it trains like one process there; tests/conftest.py runs it
    once): every stage's compiled code runs the ring, its block kernels and the K/V hand-off."""
    for r in inductor_runs["inductor_pp2_cp2_params_small_buckets_m4"]:
        code = "\n".join(r["code"])
        assert "_scaled_dot_product_flash_attention_for_cpu" in code and "_c10d_functional" in code


def test_pp2_by_cp2_with_the_tied_head_matches_the_single_process_reference():
    job = Job(pp=2, dp=1, cp=2, steps=3)
    assert_matches(job, run_ranks(rank_main, job.world, job, timeout_s=400))


def test_hand_written_attention_under_cp_stops_with_the_module_named():
    msg = run_ranks(hand_written_attention_under_cp, 2)[0]
    assert msg.startswith("NotImplementedError") and "silently wrong" in msg and "softmax" in msg


def test_a_sequence_padded_for_cp_gives_the_loss_and_gradients_of_the_unpadded_one():
    """pad_to_multiple puts every pad at the end, on some CP ranks only; the loss is still the
    mean over the global batch's labelled tokens, as in one process without the pads."""
    import torch
    from tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch
    ranks = run_ranks(padded_sequence_under_cp, 2, 14, timeout_s=200)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(seq=16))
    x, y = make_batch(4, GPTConfig(seq=14), seed=1)
    loss = lm_loss(model(x), y)
    loss.backward()
    ref = {"grads": {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}}
    for r in ranks:
        assert abs(r["loss"] - loss.item()) <= 1e-6 * loss.item()
    assert gradient_error(ref, ranks) < 1e-5
