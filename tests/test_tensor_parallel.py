"""Tensor and sequence parallelism found from the graph (passes/tensor_parallel.py) equals one process.

Each rank compiles the unmodified model (our tiny GPT, Hugging Face Llama with GQA, Qwen2 with
biases on q/k/v, GPT-2 with its Conv1D projections) with the pass, which finds the Megatron pairs, the vocab-parallel tie and the
sequence-parallel regions by itself; its loss and its gradients (a shard's against the same chunk of
the whole gradient) are compared with the whole model in one float64 process. A case's loss is
computed outside the compiled model (whole logits), or compiled with it (loss parallel: the logits are
never gathered), plain or with label smoothing and ignored targets. Every backward graph is proved by
passes/verify_tensor_parallel.py before it runs. One set of processes a world size runs every case.
"""
import math

import pytest

from gradsched.launch import run_ranks
from test_context_parallel_pass import dynamo_graph
from tp_fns import tensor_parallel_cases

EXACT = 1e-12
TP2 = [("tiny_gpt", "eager", "float64", "outside"), ("tiny_gpt", "inductor", "float64", "in_graph"),
       ("hf_llama", "eager", "float64", "outside"), ("hf_llama", "eager", "float64", "smoothed"),
       ("hf_gpt2", "eager", "float64", "outside"), ("hf_gpt2", "inductor", "float64", "in_graph"),
       ("hf_llama", "inductor", "float32", "in_graph"), ("hf_qwen2", "eager", "float64", "smoothed"),
       ("tiny_gpt", "eager", "float64", "in_graph"), ("tiny_gpt_checkpointed", "eager", "float64", "in_graph"),
       ("tiny_gpt_selective", "inductor", "float64", "in_graph")]
TP4 = [("tiny_gpt", "eager", "float64", "in_graph"), ("hf_llama", "eager", "float64", "in_graph"),
       ("hf_gpt2", "eager", "float64", "smoothed"), ("hf_qwen2", "eager", "float64", "in_graph")]


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(tensor_parallel_cases, 2, TP2, timeout_s=900)


@pytest.fixture(scope="module")
def tp4():
    return run_ranks(tensor_parallel_cases, 4, TP4, timeout_s=900)


@pytest.mark.parametrize("case", [c for c in TP2 if c[2] == "float64"], ids="-".join)
def test_float64_loss_and_gradients_at_tp2_equal_one_process(tp2, case):
    for rank in tp2:
        assert rank[case]["err"] < EXACT, (case, rank[case]["err"])


@pytest.mark.parametrize("case", TP4, ids="-".join)
def test_float64_loss_and_gradients_at_tp4_equal_one_process(tp4, case):
    for rank in tp4:
        assert rank[case]["err"] < EXACT, (case, rank[case]["err"])


def test_float32_llama_under_inductor_is_no_further_from_float64_than_one_float32_process(tp2):
    """Its gradients (every element) no further from float64 than one float32 process's; its loss, one
    rounded scalar, within that process's error and one float32 rounding of the loss."""
    for rank in tp2:
        r = rank[("hf_llama", "inductor", "float32", "in_graph")]
        assert math.isfinite(r["single_grad_err"]) and r["grad_err"] <= r["single_grad_err"], r
        assert r["loss_err"] <= r["single_loss_err"] + r["loss_ulp"], r


def test_the_tiny_gpt_is_split_as_megatron_splits_it(tp2):
    p = tp2[0][("tiny_gpt", "eager", "float64", "outside")]["partitions"]
    assert p["wte.weight"] == ("vocab", 0, 1)  # the embedding and the tied head, one shard a rank
    assert p["blocks.0.qkv.weight"] == ("column", 0, 3)  # each of q, k, v split by heads
    assert p["blocks.0.proj.weight"] == ("row", 1, 1)
    assert p["blocks.0.fc.weight"] == p["blocks.0.fc.bias"] == ("column", 0, 1)
    assert p["blocks.0.out.weight"] == ("row", 1, 1)
    for whole in ("wpe.weight", "blocks.0.ln1.weight", "blocks.0.proj.bias", "blocks.0.out.bias", "ln_f.bias"):
        assert p[whole] == ("replicated", None, 1), whole


def test_every_rank_finds_the_same_partitions_and_issues_the_same_collectives_in_order(tp2, tp4):
    """Matched by identity: each collective's kind and what it reduces (a gradient sum names its parameter),
    position by position. Sums of same-shaped gradients issued in another order on one rank would add
    unrelated tensors without any error."""
    for ranks in (tp2, tp4):
        for case in ranks[0]:
            assert all(r[case]["partitions"] == ranks[0][case]["partitions"] for r in ranks), case
            assert all(r[case]["collectives"] == ranks[0][case]["collectives"] for r in ranks), case


def test_llama_keys_and_values_with_fewer_heads_than_tp_stay_whole_and_its_queries_split(tp2, tp4):
    at4 = tp4[0][("hf_llama", "eager", "float64", "in_graph")]["partitions"]
    assert at4["model.layers.0.self_attn.k_proj.weight"] == ("replicated", None, 1)
    assert at4["model.layers.0.self_attn.q_proj.weight"] == ("column", 0, 1)
    at2 = tp2[0][("hf_llama", "eager", "float64", "outside")]["partitions"]
    assert at2["model.layers.0.self_attn.k_proj.weight"] == ("column", 0, 1)
    assert at2["model.layers.0.mlp.gate_proj.weight"] == at2["model.layers.0.mlp.up_proj.weight"] == ("column", 0, 1)
    assert at2["model.layers.0.mlp.down_proj.weight"] == ("row", 1, 1)


def test_gpt2_conv1d_weights_split_along_their_output_features(tp2):
    p = tp2[0][("hf_gpt2", "eager", "float64", "outside")]["partitions"]
    assert p["transformer.h.0.attn.c_attn.weight"] == ("column", 1, 3)  # Conv1D holds [in, out]
    assert p["transformer.h.0.attn.c_proj.weight"] == ("row", 0, 1)
    assert p["transformer.wte.weight"] == ("vocab", 0, 1)


def test_one_all_gather_a_block_serves_q_k_and_v_and_one_the_mlp(tp2):
    """Megatron's count a layer: an all-gather before the attention's and the MLP's column-parallel linears,
    a reduce-scatter after each row-parallel one; then the embedding's reduce-scatter, the head's all-gather
    and, with the loss outside, the logits' gather."""
    layers = 2
    for model in ("tiny_gpt", "hf_llama", "hf_gpt2"):
        kinds = [k for k, _ in tp2[0][(model, "eager", "float64", "outside")]["collectives"]]
        assert kinds.count("all_gather") == 2 * layers + 2, (model, kinds)
        assert kinds.count("reduce_scatter") == 2 * layers + 1, (model, kinds)


def test_a_loss_compiled_with_the_model_never_gathers_the_logits(tp2, tp4):
    for ranks in (tp2, tp4):
        for case, r in ranks[0].items():
            if case[3] != "outside":
                assert [k for k, n in r["collectives"] if n.startswith("gather_output")] == [], case
                assert ("all_reduce", "cross_entropy") in r["collectives"], case


def test_every_backward_graph_is_proved_and_refused_with_any_tp_sum_removed_or_added(tp2, tp4):
    """Each replicated gradient's sum over TP removed in turn, and one added to each sharded gradient: the
    verifier refuses every such graph, naming the parameter's gradient."""
    for ranks in (tp2, tp4):
        for case, r in ranks[0].items():
            (proved,) = r["proved"]
            assert {how for _, how in proved} == {"summed once", "never summed"}, case
            assert len(proved) == len(r["partitions"]) == len(r["refusals"]), case
            for param, why in r["refusals"].items():
                assert why is not None and "TP" in why, (case, param, why)


def test_the_replicated_gradients_are_summed_over_tp_in_one_all_reduce(tp2, tp4):
    """Every gradient summed over TP (norm weights, a GQA key/value projection kept whole) is a slice of one
    all-reduce of their concatenation, as Megatron coalesces its norms' (the values: the test above)."""
    for ranks in (tp2, tp4):
        for case, r in ranks[0].items():
            (proved,) = r["proved"]
            summed = {name for name, how in proved if how == "summed once"}
            (buckets,) = r["buckets"]
            assert len(buckets) == 1 and set(buckets[0][1]) == summed, (case, buckets, summed)


def test_checkpointed_blocks_split_alike_and_recompute_their_gathers_in_the_backward(tp2):
    """Activation checkpointing's bodies are rewritten like the graph around them; their sequence all-gathers
    run again in the backward (the recompute), two a block."""
    plain = tp2[0][("tiny_gpt", "eager", "float64", "in_graph")]
    for mode in ("tiny_gpt_checkpointed", "tiny_gpt_selective"):
        r = tp2[0][(mode, "eager" if mode.endswith("checkpointed") else "inductor", "float64", "in_graph")]
        assert r["partitions"] == plain["partitions"], mode
        assert r["backward_gathers"] == plain["backward_gathers"] + 2 * 2, (mode, r["backward_gathers"])


# ---- refusals, in one process: the pass reads the graph before any collective ------------------------------

def _spec(tp: int, seq: int):
    from gradsched.passes.tensor_parallel import TensorParallelSpec
    from gradsched.tp import collectives as c
    return TensorParallelSpec(tp, 0, "tp", seq, c.gather_sequence, c.scatter_sequence, c.grad_sum, c.gather_output)


def _refusal(model, tp: int, seq: int) -> str:
    import torch
    from gradsched.passes.tensor_parallel import TensorParallelError, shard_for_tensor_parallel
    from tiny_gpt import GPTConfig, make_batch
    x, _ = make_batch(2, GPTConfig(seq=seq, vocab=model.config.vocab))
    gm = dynamo_graph(model, x)
    with pytest.raises(TensorParallelError) as e:
        shard_for_tensor_parallel(gm, _spec(tp, seq))
    torch._dynamo.reset()
    return str(e.value)


def test_heads_that_tp_does_not_divide_are_refused_at_their_source_line():
    from tiny_gpt import GPTConfig, TinyGPT
    msg = _refusal(TinyGPT(GPTConfig(dim=24, heads=3)), 2, 16)
    assert "tiny_gpt.py" in msg and "tp=2" in msg, msg


def test_a_sequence_that_tp_does_not_divide_is_refused():
    from tiny_gpt import GPTConfig, TinyGPT
    msg = _refusal(TinyGPT(GPTConfig(seq=15)), 2, 15)
    assert "15 tokens" in msg and "divisible by 2" in msg, msg


def test_an_op_that_mixes_heads_is_refused_by_name():
    import torch
    from tiny_gpt import GPTConfig, TinyGPT

    class MixHeads(TinyGPT):  # every head's output summed into each: wrong on a rank's heads alone
        def forward(self, idx):
            for block in self.blocks:
                block.forward = lambda x, b=block: _mixing_block(b, x)
            return super().forward(idx)

    def _mixing_block(b, x):
        B, T, C = x.shape
        q, k, v = b.qkv(b.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, b.heads, C // b.heads).transpose(1, 2) for t in (q, k, v))
        q = q + q.mean(dim=1, keepdim=True)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + b.proj(y.transpose(1, 2).reshape(B, T, C))
    msg = _refusal(MixHeads(GPTConfig(layers=1)), 2, 16)
    assert "test_tensor_parallel.py" in msg and "mean" in msg, msg


def test_a_padding_index_of_zero_on_the_vocab_parallel_embedding_is_refused_not_dropped():
    from tiny_gpt import GPTConfig, TinyGPT
    model = TinyGPT(GPTConfig())
    model.wte.padding_idx = 0  # 0 == False: must not pass for the default
    msg = _refusal(model, 2, 16)
    assert "padding_idx" in msg, msg


def test_a_fused_projection_split_into_unequal_blocks_is_refused():
    """Fused GQA (q wider than k and v): cutting the weight in equal thirds would hand a rank another head."""
    import torch
    from tiny_gpt import GPTConfig, TinyGPT

    class FusedGQA(TinyGPT):
        def __init__(self, c):
            super().__init__(c)
            for b in self.blocks:  # 4 query heads, 2 key/value heads of 8
                b.qkv = torch.nn.Linear(c.dim, c.dim + 2 * 16, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks:
                B, T, C = x.shape
                q, k, v = b.qkv(b.ln1(x)).split((C, 16, 16), dim=2)
                q = q.view(B, T, 4, 8).transpose(1, 2)
                k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in (k, v))
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                x = x + b.proj(y.transpose(1, 2).reshape(B, T, C))
            return self.lm_head(self.ln_f(x))
    msg = _refusal(FusedGQA(GPTConfig(layers=1)), 2, 16)
    assert "split" in msg and "test_tensor_parallel.py" in msg, msg


def test_dropout_on_a_ranks_tokens_is_refused():
    import torch
    from tiny_gpt import GPTConfig, TinyGPT

    class Dropped(TinyGPT):
        def forward(self, idx):
            return super().forward(idx)
    model = Dropped(GPTConfig(layers=1))
    model.ln_f.register_forward_hook(lambda m, i, out: torch.nn.functional.dropout(out, 0.1, training=True))
    msg = _refusal(model, 2, 16)
    assert "dropout" in msg and "p=0.1" in msg, msg
