"""Tensor + sequence parallelism: gradsched's graph pass against torch's own DTensor TP, same run.

The same tied Hugging Face Llama (GQA), unmodified, on tp processes (tp=2 and 4 by default), each step a
forward, the loss and a backward (no optimizer: both sides would step the same shards):

  gradsched  passes/tensor_parallel.py on the model and its loss compiled together
             (gradsched.tp.local_graph): Megatron's pairs and sequence parallelism found from the graph,
             loss parallel, every backward proved before it runs;
  dtensor    torch's parallelize_module with torchtitan's Llama plan (ColwiseParallel, RowwiseParallel,
             SequenceParallel, PrepareModuleInput) on HF's module names, the head re-tied to the embedding
             after it (parallelize_module unties them), loss_parallel over its vocab-sharded logits.

Both compiled with torch.compile (Inductor; `--compiler eager` for AOTAutograd's eager graphs), steps
interleaved on the same processes; then gradsched alone at tp 2 x pp 2 (`--pp`; 1F1B, 2 micro-batches, its
train_step timed: no DTensor peer, torch's pipelining has no tie across stages; its logits are those the loss
after the last stage reads, its TP bytes are read at pp 1 only). One JSON object per implementation and layout: "bench": "tensor_parallel",
"impl", "tp", "pp", "dp", "step_ms_median" (the slowest rank's, median over steps), "vs_dtensor",
"peak_bytes_per_rank" (the step's peak above its start, on the step's own thread), "logits_bytes_per_rank",
"tp_bytes_per_step" (gradsched: read from its compiled graphs), "tp_bytes_formula" (what Megatron's SP
moves for this plan: per layer 4 collectives forward and 4 backward of (tp-1)/tp x batch x sequence x hidden
elements, the embedding's and the head's 2 each, the loss's all-reduces of 3 x batch x sequence floats (the
maximum, then both sums in one), the replicated gradients' all-reduce; no recompute), "max_rel_grad_diff_vs_one_process" (against the whole model
in one float64 process, relative to its largest gradient).

CPU timings here are ratios of the two measured side by side; absolute times only from a GPU, named.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from common import RESULTS, emit, peak_increment
from gradsched.launch import run_ranks

CONFIG = dict(vocab=4096, hidden=256, intermediate=704, layers=2, heads=8, kv_heads=4, seq=256, batch=2)


def build(c: dict, dtype=torch.float32):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                                   num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                   num_key_value_heads=c["kv_heads"], tie_word_embeddings=True,
                                   max_position_embeddings=c["seq"], use_cache=False)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def loss_of(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(c: dict):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def dtensor_plan(layers: int) -> dict:
    """torchtitan's Llama plan (models/llama3/infra/parallelize.py) on Hugging Face's module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    # the sequence-parallel region's values stay DTensors (use_local_output=False): Hugging Face's model reads
    # the sequence length from the embedding's output for its positions (torchtitan's precomputes them)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(layers):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    return plan


def _inner(compiler: str):
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner
        return compile_fx_inner
    from functorch.compile import make_boxed_func
    return lambda gm, example_inputs: make_boxed_func(gm.forward)


def rank_run(rank, world, c: dict, compiler: str, steps: int) -> dict:
    import gradsched
    from gradsched.passes.tp_layouts import take_chunk
    from tied_training import abs_diff
    from gradsched.tp.local_graph import collective_bytes, compile_local, tensor_parallel_spec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    plan = gradsched.ParallelPlan.from_world(tp=world)
    x, y = batch(c)
    ref = build(c, torch.float64)
    loss_of(ref(input_ids=x).logits, y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    del ref

    # gradsched
    ours, local = build(c), []

    def backend(gm, example_inputs):
        by_id = {id(p): n for n, p in ours.named_parameters()}
        names = {i: by_id[id(e)] for i, e in enumerate(example_inputs) if id(e) in by_id}
        lg = compile_local(gm, example_inputs, tensor_parallel_spec(plan, c["seq"]), _inner(compiler), names)
        local.append((names, lg))
        return lg.forward
    our_step = torch.compile(lambda x, y: loss_of(ours(input_ids=x).logits, y), backend=backend, fullgraph=True)

    # torch's DTensor TP, re-tied
    theirs = build(c)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(theirs, mesh, dtensor_plan(c["layers"]))
    theirs.lm_head.weight = theirs.model.embed_tokens.weight
    their_model = torch.compile(theirs, backend=compiler if compiler == "inductor" else "aot_eager")

    their_logits = []

    def their_step(x, y):
        with loss_parallel():
            logits = their_model(input_ids=x).logits
            their_logits[:] = [logits.to_local().numel() * logits.to_local().element_size()]
            loss = loss_of(logits, y)
            loss.backward()
        return loss

    def one(impl):
        model = ours if impl == "gradsched" else theirs
        model.zero_grad(set_to_none=True)
        for shard in (lg.shards.values() for _, lg in local) if impl == "gradsched" else ():
            for p in shard:
                p.grad = None  # this rank's shards, which the model does not hold
        t = time.perf_counter()
        if impl == "gradsched":
            our_step(x, y).backward()
        else:
            their_step(x, y)
        return time.perf_counter() - t

    times = {"gradsched": [], "dtensor": []}
    for impl in times:  # compile, then a warm step each
        one(impl)
        one(impl)
    for _ in range(steps):
        for impl in times:
            times[impl].append(one(impl))
    peaks = {}
    for impl in times:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            one(impl)
        peaks[impl] = peak_increment(prof)

    (names, lg), = local
    t = plan.index("tp")
    ours_err = 0.0
    shard_of = {names[i]: (s, lg.partitions[i]) for i, s in lg.shards.items()}
    for n, p in ours.named_parameters():
        s, pl = shard_of.get(n, (p, None))
        want = ref_grads[n] if pl is None else take_chunk(ref_grads[n], pl.dim, pl.segments, world, t)
        ours_err = max(ours_err, abs_diff(s.grad.double(), want))  # inf on NaN: max(0.0, nan) is 0.0
    theirs_err = 0.0
    for n, p in theirs.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        theirs_err = max(theirs_err, abs_diff(g.double(), ref_grads[n]))
    logits = [n.meta["val"] for gm in lg.forward_graphs for n in gm.graph.nodes
              if n.op == "call_function" and n.target is torch.ops.aten.mm.default
              and n.meta["val"].shape[-1] == c["vocab"] // world]
    params = dict(ours.named_parameters())
    return {"times": times, "peaks": {k: int(v) for k, v in peaks.items()},
            "bytes": int(collective_bytes(lg.forward_graphs + lg.backward_graphs, world)),
            "logits_bytes": {"gradsched": int(logits[-1].numel() * logits[-1].element_size()) if logits else None,
                             "dtensor": int(their_logits[0])},
            "errors": {"gradsched": float(ours_err / scale), "dtensor": float(theirs_err / scale)},
            "replicated_numel": int(sum(params[names[i]].numel() for i, p in lg.partitions.items() if p.dim is None))}


class Logits(torch.nn.Module):
    """The HF model's logits as its output (gradsched.parallelize trains a module whose output the loss takes)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens).logits


def pipeline_rank_run(rank, world, c: dict, compiler: str, steps: int, pp: int) -> dict:
    """gradsched.parallelize at tp x pp (1F1B, 2 micro-batches, shard=False): each step's train_step (every
    stage's forward and backward, the tie's all-reduce over its TP shard, the gradients' reductions)."""
    import gradsched
    from gradsched.passes.tp_layouts import take_chunk
    from tied_training import abs_diff, reduced_gradients
    tp = world // pp
    x, y = batch(c)
    ref = Logits(build(c, torch.float64))
    loss_of(ref(x), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    del ref
    plan = gradsched.ParallelPlan.from_world(tp=tp, pp=pp)
    split = tuple(f"model.model.layers.{i * c['layers'] // pp}" for i in range(1, pp))
    model = gradsched.parallelize(Logits(build(c)), plan=plan, loss_fn=loss_of, compiler=compiler,
                                  split_points=split, microbatches=2, schedule="1f1b", shard=False)
    # lr 0: the step's check and zeroing run between the timed train_steps, the weights stay the reference's
    opt = gradsched.DistributedOptimizer(model, torch.optim.SGD, lr=0.0)
    times, grads = [], None
    for i in range(2 + steps):  # compile, a warm step, then the timed ones
        t = time.perf_counter()
        model.train_step(x, y)
        if i >= 2:
            times.append(time.perf_counter() - t)
        grads = grads or reduced_gradients(model.grad_sync)["full"]
        opt.step()
        opt.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model.train_step(x, y)
    opt.step()
    shards = model.model_state.tp_shards
    whole = dict(model.model_state.trained_module().named_parameters())
    t_idx, err = plan.index("tp"), 0.0
    for n, g in grads.items():
        part = shards.partition_of(whole[n]) if shards is not None and n in whole else None
        want = ref_grads[n] if part is None else take_chunk(ref_grads[n], part.dim, part.segments, tp, t_idx)
        err = max(err, abs_diff(g.double(), want))  # inf on NaN
    # the last stage's logits, as its loss reads them: each micro-batch's local columns (loss parallel)
    shapes = model.global_loss.vocab_parallel.shapes
    logits = 2 * math.prod(shapes[0]) * 4 if shapes else None  # 2 micro-batches, fp32
    return {"times": times, "peak": int(peak_increment(prof)), "error": float(err / scale), "logits": logits}


def formula(c: dict, tp: int, replicated_numel: int, elem: int = 4) -> int:
    """What Megatron's sequence parallelism moves a step for this plan, in bytes a rank sends."""
    act = (tp - 1) / tp * c["batch"] * c["seq"] * c["hidden"] * elem
    layers = c["layers"] * 8 * act  # per layer: 2 all-gathers + 2 reduce-scatters forward, their conjugates backward
    ends = 2 * act + 2 * act  # the embedding's reduce-scatter and its backward; the head's all-gather and its backward
    loss = 3 * 2 * (tp - 1) / tp * c["batch"] * c["seq"] * 4  # max, sum-exp, the target's logit: fp32 all-reduces
    grads = 2 * (tp - 1) / tp * replicated_numel * elem  # the norms' gradients summed over TP
    return round(layers + ends + loss + grads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pp", type=int, nargs="*", default=[2], help="also gradsched at tp 2 x each pp (no DTensor "
                    "peer: torch's pipelining has no tie across stages, torchtitan refuses ties under pipeline "
                    "parallelism); none to skip")
    ap.add_argument("--steps", type=int, default=20, help="timed steps a layout (the median of the slowest rank's)")
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--out", default=None, help="results file ('' for none); default benchmarks/results/"
                    "tensor_parallel.jsonl")
    args = ap.parse_args(argv)
    c = CONFIG
    out = args.out if args.out is not None else RESULTS / "tensor_parallel.jsonl"
    one_logits = c["batch"] * c["seq"] * c["vocab"] * 4
    rows = []
    for tp in args.tp:
        print(f"tensor_parallel.py: gradsched and DTensor on the same {tp} processes, steps interleaved ...",
              file=sys.stderr, flush=True)
        ranks = run_ranks(rank_run, tp, c, args.compiler, args.steps, timeout_s=1800)
        ms = {impl: 1e3 * statistics.median(max(s) for s in zip(*(r["times"][impl] for r in ranks)))
              for impl in ("gradsched", "dtensor")}
        for impl in ("gradsched", "dtensor"):
            rows.append({"bench": "tensor_parallel", "impl": impl, "tp": tp, "pp": 1, "dp": 1,
                         "compiler": args.compiler, "model": "hf_llama (tied, GQA)", **c,
                         "step_ms_median": round(ms[impl], 2), "vs_dtensor": round(ms[impl] / ms["dtensor"], 3),
                         "peak_bytes_per_rank": max(r["peaks"][impl] for r in ranks),
                         "logits_bytes_per_rank": ranks[0]["logits_bytes"][impl],
                         "one_process_logits_bytes": one_logits,
                         "tp_bytes_per_step": ranks[0]["bytes"] if impl == "gradsched" else None,
                         "tp_bytes_formula": formula(c, tp, ranks[0]["replicated_numel"]),
                         "max_rel_grad_diff_vs_one_process": max(r["errors"][impl] for r in ranks)})
    for pp in args.pp:
        print(f"tensor_parallel.py: gradsched at tp 2 x pp {pp} ...", file=sys.stderr, flush=True)
        ranks = run_ranks(pipeline_rank_run, 2 * pp, c, args.compiler, args.steps, pp, timeout_s=1800)
        ms = 1e3 * statistics.median(max(s) for s in zip(*(r["times"] for r in ranks)))
        rows.append({"bench": "tensor_parallel", "impl": "gradsched", "tp": 2, "pp": pp, "dp": 1,
                     "compiler": args.compiler, "model": "hf_llama (tied, GQA)", **c, "schedule": "1f1b",
                     "microbatches": 2, "step_ms_median": round(ms, 2), "vs_dtensor": None,
                     "dtensor": "no peer: torch's pipelining has no tie across stages",
                     "peak_bytes_per_rank": max(r["peak"] for r in ranks),
                     "logits_bytes_per_rank": max((r["logits"] for r in ranks if r["logits"]), default=None),
                     "one_process_logits_bytes": one_logits,
                     "tp_bytes_per_step": None, "tp_bytes_formula": None,  # read at pp 1 only (one local graph)
                     "max_rel_grad_diff_vs_one_process": max(r["error"] for r in ranks)})
    emit(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
