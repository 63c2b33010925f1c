"""Per-rank bodies of the tensor-parallel tests: each case's model in one process (the reference) and
over the TP group (passes/tensor_parallel.py through gradsched.tp.local_graph), on every rank."""
import copy
import math

import torch
import torch.nn.functional as F

import gradsched
from gradsched.passes.tp_layouts import take_chunk
from gradsched.tp.local_graph import compile_local, tensor_parallel_spec
from tied_training import abs_diff
from tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch

SEQ = 16


def build(model: str, dtype: torch.dtype):
    """(model, forward(model, tokens) -> logits), the same weights in every process."""
    torch.manual_seed(0)
    if model in ("tiny_gpt", "tiny_gpt_checkpointed", "tiny_gpt_selective"):  # every block checkpointed, or selectively
        mode = {"tiny_gpt": "", "tiny_gpt_checkpointed": "non_reentrant", "tiny_gpt_selective": "selective"}[model]
        return TinyGPT(GPTConfig(seq=SEQ, checkpoint=mode)).to(dtype), lambda m, x, pos=None: m(x, pos)
    if model == "gradsched_llama":  # through gradsched.hf.CausalLM: its attention is SDPA with enable_gqa
        from gradsched.hf import tiny_llama
        return tiny_llama(seq=SEQ)[0].to(dtype), lambda m, x, pos=None: m(x, pos)
    if model == "gradsched_gpt2":  # Hugging Face's GPT-2 through gradsched.hf.CausalLM (positions passed in)
        from gradsched.hf import tiny_gpt2
        return tiny_gpt2(seq=SEQ)[0].to(dtype), lambda m, x, pos=None: m(x, pos)
    import transformers
    if model == "hf_llama":  # GQA: 2 key/value heads for 4 query heads (fewer than tp at tp 4)
        c = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                     max_position_embeddings=SEQ, use_cache=False)
        c._attn_implementation = "sdpa"
        m = transformers.LlamaForCausalLM(c)
    elif model == "hf_qwen2":  # biases on q, k and v (split with their columns), GQA
        c = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                     max_position_embeddings=SEQ, use_cache=False, use_sliding_window=False)
        c._attn_implementation = "sdpa"
        m = transformers.Qwen2ForCausalLM(c)
    elif model == "hf_gpt2":  # Conv1D (addmm) projections, a fused q/k/v, learned positions
        c = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, use_cache=False,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        c._attn_implementation = "sdpa"
        m = transformers.GPT2LMHeadModel(c)
        m.loss_type = "ForCausalLM"
    else:
        raise ValueError(model)
    return m.to(dtype), lambda m, x, pos=None: m(input_ids=x, position_ids=pos).logits


def _inner(name: str):
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner
        return compile_fx_inner
    from functorch.compile import make_boxed_func
    return lambda gm, example_inputs: make_boxed_func(gm.forward)


def in_graph_loss(logits, targets):
    """lm_loss in the logits' own dtype (lm_loss computes in float32, which no float64 comparison could pass)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def smoothed_loss(logits, targets):
    """Label smoothing over the whole vocabulary, ignored targets, summed: what loss parallel must match."""
    targets = targets.masked_fill(targets % 5 == 0, -100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum",
                           label_smoothing=0.1)


LOSSES = {"outside": lm_loss, "in_graph": in_graph_loss, "smoothed": smoothed_loss}


def one_case(plan, model: str, compiler: str, dtype: torch.dtype, loss: str = "outside") -> dict:
    """Step-1 loss and gradients over tp ranks against the float64 model in this one process: the worst
    |difference| (inf on any NaN), and, for float32, the same of the float32 model in one process.
    loss="outside": the compiled model returns whole logits; otherwise the loss is compiled with it (loss
    parallel: the logits are never gathered)."""
    torch._dynamo.reset()  # each case compiles afresh: Dynamo's per-code caches (and their size limit) are per process
    x, y = make_batch(2, GPTConfig(seq=SEQ), seed=1)
    loss_fn = LOSSES[loss]
    ref_model, fwd = build(model, torch.float64)
    ref_loss = loss_fn(fwd(ref_model, x), y)
    ref_loss.backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    out = {}
    if dtype != torch.float64:
        single, _ = build(model, dtype)
        single_loss = loss_fn(fwd(single, x), y)
        single_loss.backward()
        out["single_loss_err"] = abs_diff(single_loss.detach().double(), ref_loss.detach())
        out["single_grad_err"] = max(abs_diff(p.grad.double(), ref[n]) for n, p in single.named_parameters())
        out["loss_ulp"] = torch.finfo(dtype).eps * abs(ref_loss.item())

    m, _ = build(model, dtype)
    spec, local = tensor_parallel_spec(plan, SEQ), []

    def backend(gm, example_inputs):
        by_id = {id(p): n for n, p in m.named_parameters()}
        names = {i: by_id[id(e)] for i, e in enumerate(example_inputs) if id(e) in by_id}
        lg = compile_local(gm, example_inputs, spec, _inner(compiler), names)
        local.append((names, lg))
        return lg.forward

    if loss == "outside":
        loss = loss_fn(fwd(torch.compile(m, backend=backend, fullgraph=True), x), y)
    else:
        loss = torch.compile(lambda x, y: loss_fn(fwd(m, x), y), backend=backend, fullgraph=True)(x, y)
    loss.backward()
    (names, lg), = local
    shard_of = {names[i]: (s, lg.partitions[i]) for i, s in lg.shards.items()}
    out["loss_err"] = abs_diff(loss.detach().double(), ref_loss.detach())
    grad_err, partitions = 0.0, {}
    for n, p in m.named_parameters():
        if n in shard_of:
            s, pl = shard_of[n]
            got, want = s.grad, take_chunk(ref[n], pl.dim, pl.segments, plan.tp, plan.index("tp"))
            partitions[n] = (pl.role, pl.dim, pl.segments)
        else:
            got, want = p.grad, ref[n]
            partitions[n] = ("replicated", None, 1)
        grad_err = max(grad_err, math.inf if got is None else abs_diff(got.double(), want))
    out.update(grad_err=grad_err, err=max(grad_err, out["loss_err"]), partitions=partitions, collectives=list(lg.record.collectives),
               proved=[p.proved for p in lg.proofs], refusals=_verifier_refusals(lg, plan),
               buckets=[b.buckets for b in lg.buckets],
               backward_gathers=sum(1 for n in lg.backward_graphs[0].graph.nodes
                                    if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default))
    return out


def _verifier_refusals(lg, plan) -> dict:
    """Each TP sum of the backward graph removed in turn, and one added to each sharded gradient: what the
    verifier says of each such graph (graph input index -> its refusal, None had it passed)."""
    from gradsched.passes.graph_utils import collective_group, collective_kind, is_collective
    from gradsched.passes.verify_tensor_parallel import TensorParallelGradSpec, verify_tensor_parallel
    c10d = torch.ops._c10d_functional
    (bw,) = lg.backward_graphs
    group = plan.process_group("tp").group_name
    grads = {}
    for out, desc in enumerate(bw.graph.output_node().meta.get("desc") or []):
        i = getattr(getattr(desc, "grad_of", None), "idx", None)
        if i in lg.partitions:
            grads[out] = (str(i), lg.partitions[i].dim is None)
    spec = TensorParallelGradSpec(group, grads)
    refusals = {}
    for o, (i, replicated) in grads.items():
        g = copy.deepcopy(bw)
        outputs = list(g.graph.output_node().args[0])
        if replicated:  # its sum removed: wait(all_reduce(x)) -> x
            sums = [n for n in g.graph.nodes if is_collective(n) and collective_kind(n) == "all_reduce"
                    and collective_group(n) == group and outputs[o] in {w for u in n.users for w in (u, *u.users)}]
            for wait in list(sums[0].users):
                wait.replace_all_uses_with(sums[0].args[0])
        else:  # a sum added
            with g.graph.inserting_before(g.graph.output_node()):
                ar = g.graph.call_function(c10d.all_reduce.default, (outputs[o], "sum", group))
                outputs[o] = g.graph.call_function(c10d.wait_tensor.default, (ar,))
            g.graph.output_node().args = (tuple(outputs),)
        proof = verify_tensor_parallel(g, spec)
        refusals[i] = None if proof.ok else "; ".join(proof.hazards)
    return refusals


def tensor_parallel_cases(rank, world, cases):
    """Every case on one set of processes (a TP group of the whole world)."""
    plan = gradsched.ParallelPlan.from_world(tp=world)
    return {case: one_case(plan, case[0], case[1], getattr(torch, case[2]), *case[3:]) for case in cases}
