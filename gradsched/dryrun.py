"""python -m gradsched.dryrun: what a training plan needs per rank, before the GPUs are rented.

    python -m gradsched.dryrun --model llama-70b --pp 8 --dp 16 --cp 8 --shard params

The model is built on the meta device (shapes, no values). For each pipeline stage, one rank of it (its
data- and context-parallel peers hold the same shapes) runs three training steps in this one process, on
torch's fake process group (collectives return without sending anything): parallelize's own stage build,
every gradsched pass, the graphs run by compiler="eager", the micro-batches in the order of the
pipeline schedule (emulated: `schedule_order`), and the DistributedOptimizer's step. The third step is
counted as it runs (gradsched.training.live_bytes.LiveBytes); what is added by hand is named: the
pipeline stage's receive buffers, each backend's collective scratch (WORKSPACE, measured on gloo), and
the device runtime's own buffers (RUNTIME: cuBLAS's workspaces on CUDA, measured on an H100).

Per role it prints:
  memory    parameters, gradients (the reduced shards and any whole .grad), fp32 masters and optimizer
            state held when the third step's optimizer steps, and the peak: what was held at that step's
            start, plus the most the step's ops held at once (a functional collective's input and scratch
            held from its issue to its wait), plus the additions above
  traffic   the buffer bytes of each collective per step (an all-gather's output, a reduce-scatter's
            input), by op and group, and the activations and their gradients sent between stages
  verdict   the verifier's, with every tie's layouts from every stage that holds a copy

What it cannot see: NCCL's own buffers (outside torch's allocator), allocator fragmentation and caching,
the CUDA context, and kernels' internal scratch memory. The graphs run eagerly, so a chain of pointwise
ops that Inductor fuses is materialised here: an upper bound where that chain is the peak. On a 29M
tied GPT the prediction was within 2% of an H100's max_memory_allocated, eager and Inductor
(benchmarks/results/README.md). Under cp > 1 with bf16 the block kernel is chosen as on a GPU without
Triton (bf16 block outputs; the Triton fp32-output kernel's are fp32).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from gradsched.hf import LLAMA, from_config, llama
from gradsched.sizing import args as cli_args
from gradsched.sizing.accounting import account, by_group, held_bytes, verdict
from gradsched.sizing.device_attention import DEVICES, priced_as
from gradsched.sizing.dryrun_text import count, describe, parse_bytes, size
from gradsched.sizing.roles import (Role, fake_world, like, nbytes, run_rank_schedule, run_schedule, stage_args,
                                    stage_outputs)
from gradsched.training.live_bytes import RUNTIME, LiveBytes, storage_bytes
from gradsched.training.pipeline_schedule import SCHEDULES, least_microbatches, resolve_schedule

STEPS = 3  # the first compiles, the second may compile again (Dynamo recompiles what changed), the third counts


def from_module(spec: str, dtype: torch.dtype):
    """(model on meta, split points or None) from "pkg.mod:factory": factory() returns an nn.Module whose
    forward(tokens) gives logits [batch, sequence, vocab], or (module, split points)."""
    import importlib
    mod, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"--module {spec}: give it as package.module:factory (a function returning the nn.Module)")
    factory = getattr(importlib.import_module(mod), name)
    with torch.device("meta"):
        built = factory()
    model, split_points = built if isinstance(built, tuple) else (built, None)
    return model.to(dtype), split_points


def even_split_points(layers: int, pp: int, prefix: str = "model.model.layers") -> list[str]:
    return [f"{prefix}.{layers * k // pp}" for k in range(1, pp)]


def dry_run(model, loss_fn, *, pp: int, dp: int, cp: int, batch: int, seq: int, split_points=(), tp: int = 1,
            optimizer=torch.optim.AdamW, optimizer_kwargs=None, backend="nccl", progress=print,
            device: str = "cuda", **options) -> list[Role]:
    """Measure every stage's role of a plan (see the module docstring). `model`: on the meta device (or
    any, but then its values are used); `batch`: sequences per data-parallel rank per step; `backend`:
    whose collective scratch memory to add (WORKSPACE); `device`: whose attention kernels to price
    ("cuda" or "cpu": gradsched.training.device_attention)."""
    # one process: no peer to agree with, and each stage's preflight sees only its own tie layouts (a
    # shard_aligned tie would be refused unproven); the verdict below checks every tie with every layout
    options = {"compiler": "eager", **options, "check_ranks": False, "allow_hazard": True}
    m = options.get("microbatches", 1)
    if dist.is_initialized():
        raise RuntimeError("gradsched.dryrun plays every rank on torch's fake process group in this process; "
                           "a process group is already initialized here: run the dry run in a process of its own.")
    if batch < m or batch % m:
        raise ValueError(f"gradsched.dryrun: a batch of {batch} sequences per data-parallel rank does not split "
                         f"into {m} micro-batches; use a multiple of {m}.")
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=next(model.parameters()).device)
    with warnings.catch_warnings():  # allow_hazard's warning: the verdict below says what holds
        warnings.filterwarnings("ignore", message="gradsched: running a graph with a known hazard")
        # cp > 1: the ring and Ulysses choose their block kernels by device already (meta stands for a GPU)
        with priced_as(device) if cp == 1 else contextlib.nullcontext():
            return _dry_run(model, loss_fn, pp, dp, cp, tp, m, tokens, split_points, optimizer, optimizer_kwargs,
                            backend, progress, options)


def _dry_run(model, loss_fn, pp, dp, cp, tp, m, tokens, split_points, optimizer, optimizer_kwargs, backend, progress,
             options) -> list[Role]:
    from gradsched.parallel import ParallelModel
    from gradsched.plan import ParallelPlan
    from gradsched.training.optimizer import DistributedOptimizer
    sizes = ParallelPlan(pp=pp, dp=dp, cp=cp, tp=tp)  # the layout alone: the rank arithmetic, no groups
    world = sizes.world
    roles, built, sent, pipe = [], [], [], None
    try:
        for stage in range(pp):  # a pipeline rank: its stage, or its stages (several a rank)
            t0 = time.perf_counter()
            torch._dynamo.reset()  # each role compiles its own graphs, as its process would
            rank = sizes.rank_of(stage, 0, 0)  # dp 0, cp 0 of the stage
            fake_world(rank, world)
            plan = ParallelPlan.from_world(pp=pp, dp=dp, cp=cp, tp=tp)
            pm = ParallelModel(model, plan, loss_fn, split_points=split_points, **options)
            x, y = pm._shard_sequence(tokens, tokens)
            chunks = [tuple(t.chunk(m)[i] for t in x) for i in range(m)]
            several = pm.stages_per_rank > 1
            if pp > 1:
                if pipe is None:
                    pipe = pm.split(chunks[0])
                    sent = stage_outputs(pipe[0], chunks, pm.num_stages) if several else sent
                pm.compile_split(pipe)
            opt = DistributedOptimizer(pm, optimizer, **(optimizer_kwargs or {"lr": 1e-4}))
            n = sizes.stage_replicas * tp  # the stage's ranks, contiguous: its TP shards are equal in shape
            role = Role(stage, f"{rank}-{rank + n - 1}" if n > 1 else str(rank))
            local = list(pm.local) if several else [stage]
            last = pm.num_stages - 1 if several else pp - 1
            inputs = {s: chunks if s == 0 else [stage_args(pipe[0], s, sent, i) for i in range(m)] for s in local}
            for step in range(STEPS):
                held = held_bytes(pm, opt)
                with LiveBytes(backend) as live:
                    if several:
                        outs, saved, above, stash = run_rank_schedule(pm, inputs, y.chunk(m), stage, m, live)
                    else:
                        outs, saved, above, stash = run_schedule(pm, inputs[stage], y.chunk(m), stage, pp, m, live)
                        outs = {stage: outs}
                    if step == STEPS - 1:
                        account(role, pm, opt)
                    opt.step()
                    opt.zero_grad()
                # + torch's pipeline stage's buffers, made once and kept across steps: one set of received
                # activations per micro-batch (a stage but the first), one of received output gradients (but the last)
                received = sum(m * storage_bytes(inputs[s][0]) for s in local if s)
                grads_in = sum(m * sum(nbytes(*t) for t in outs[s][0] if t[3]) for s in local if s < last)
                role.peak = held + live.peak + received + grads_in + RUNTIME[backend]
                role.held, role.transient, role.saved = held, live.peak, saved
                role.accumulating, role.final_backward, role.stash = max(above[:-1], default=0), above[-1], stash
            role.collectives = by_group(live.collectives, plan, pm)
            if not several:
                sent.append([[like(*t) for t in o] for o in outs[stage]])  # what later stages receive
            if received:
                role.p2p["activations received"] = received
                role.p2p["their gradients sent back"] = sum(
                    m * storage_bytes([t for t in inputs[s][0] if t.requires_grad]) for s in local if s)
            role.stages = local if several else []
            role.seconds = time.perf_counter() - t0
            roles.append(role)
            built.append(pm.grad_sync)
            progress(f"dry run: {'pipeline rank' if several else 'stage'} {stage} of {pp} measured in "
                     f"{role.seconds:.0f} s")
        for role, sync in zip(roles, built):
            role.verdict = verdict(sync, built)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return roles


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=cli_args.HelpFormatter)
    ap.add_argument("--model", default="llama-8b", choices=sorted(LLAMA), help="a built-in shape (no weights)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--config", default=None, help="instead: a Hugging Face config.json (or its directory); any "
                    "*ForCausalLM transformers builds from it. Tied as the config says, or with --tie")
    which.add_argument("--module", default=None, help="instead: package.module:factory, a function returning your "
                    "nn.Module (built on meta; forward(tokens) -> logits), or (module, split points). The Python "
                    "API: gradsched.dryrun.dry_run(model, loss_fn, pp=, dp=, cp=, batch=, seq=, split_points=)")
    ap.add_argument("--split-points", default=None, help="comma-separated module names where stages begin "
                    "(default: layers split evenly; --module at pp > 1 needs them or its factory's)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism: each layer's matrices split over tp "
                    "ranks (the fastest dimension, inside a node), with sequence parallelism between them")
    ap.add_argument("--shard", default="params", choices=("params", "true", "false"),
                    help="params: ZeRO-3; true: distributed optimizer; false: all-reduce")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence (split over cp)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per data-parallel rank per step "
                    "(default: one per micro-batch)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="default: the fewest the schedule runs (pp; 2 pp - 1 for zbv, 2 pp for dualpipev)")
    ap.add_argument("--schedule", default="auto", choices=SCHEDULES, help="the pipeline's schedule (pp > 1): what "
                    "each stage holds depends on the order of its forwards and backwards (zb1p: B and W apart)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the embedding (across stages)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing: HF's activation_checkpointing_enable()")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--device", default="cuda", choices=DEVICES, help="whose kernels to price: attention as that "
                    "device runs it (cuda: flash or memory-efficient, O(S) saved state), cuBLAS workspaces on cuda")
    ap.add_argument("--json", default=None, help="also write the roles as JSON lines here")
    ap.add_argument("--plot", default=None, help="also draw each stage's memory as stacked bars into this PNG")
    ap.add_argument("--device-memory", default="80GiB", help="the device memory line of --plot (e.g. 80GiB, 141GiB)")
    ap.add_argument("--fit", default=None, metavar="MEMORY", help="instead of one plan: every layout of --gpus "
                    "ranks priced (gradsched.sizing.fit: how, and the ranking's cost), those that fit MEMORY first")
    ap.add_argument("--gpus", type=int, default=None, help="--fit: ranks to lay out")
    ap.add_argument("--global-batch", type=int, default=None, help="--fit: sequences per step (default: --gpus)")
    ap.add_argument("--top", type=int, default=10, help="--fit: plans listed")
    ap.add_argument("--flops", type=float, default=4e14, help="--fit: a rank's FLOP/s, for the ranking")
    ap.add_argument("--bandwidth", type=float, default=5e10, help="--fit: a rank's bytes/s on the wire")
    ap.add_argument("--tp-bandwidth", type=float, default=4.5e11, help="--fit: a rank's bytes/s inside its node "
                    "(tensor parallelism's collectives; NVLink on an H100 node)")
    ap.add_argument("--max-tp", type=int, default=8, help="--fit: the largest tp tried (a node's GPUs); 1: none")
    ap.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))),
                    help="--fit: probes measured at once, each in a process of its own (one core each)")
    args = ap.parse_args(argv)
    cli_args.check(ap, args)
    if args.fit:
        from gradsched.sizing.fit_run import fit_main
        return fit_main(args, probe, Cut(args.model, args.config, getattr(torch, args.dtype), args.tie))
    m = args.microbatches or least_microbatches(args.schedule, args.pp)
    dtype = getattr(torch, args.dtype)
    name, split_points = args.module or args.config or args.model, None
    try:
        if args.module:
            model, split_points = from_module(args.module, dtype)
            layers = None
        elif args.config:
            model, layers = from_config(args.config, dtype, tie=args.tie, checkpointing=args.checkpointing)
        else:
            model, layers = llama(args.model, dtype, tie=args.tie, checkpointing=args.checkpointing)
    except (ImportError, AttributeError, ValueError, KeyError, TypeError, RuntimeError) as e:  # the user's model
        flag = f"--module {args.module}" if args.module else f"--config {args.config}" if args.config else args.model
        raise SystemExit(f"{flag}: the model could not be built: {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        schedule = resolve_schedule(args.schedule, args.pp, m)
    except ValueError as e:
        raise SystemExit(f"--schedule {args.schedule} with --pp {args.pp} and {m} micro-batches: {e}") from None
    stages = args.pp * (2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1)  # two a rank
    if args.split_points:
        split_points = args.split_points.split(",")
    elif split_points is None and layers is not None:
        if stages > layers:
            two = f" ({stages} stages under {schedule}, two a rank)" if stages > args.pp else ""
            raise SystemExit(f"--pp {args.pp}{two}: {name} has {layers} layers; use pp <= {layers * args.pp // stages}.")
        split_points = even_split_points(layers, stages)
    if args.pp > 1 and len(split_points or ()) != stages - 1:
        raise SystemExit(f"--pp {args.pp} needs {stages - 1} split point(s) ({stages} stages): give --split-points "
                         "(module names).")
    shard = {"params": "params", "true": True, "false": False}[args.shard]
    layout = f"pp={args.pp} x dp={args.dp} x cp={args.cp}" + (f" x tp={args.tp}" if args.tp > 1 else "")
    print(f"dry run: {name} ({count(sum(p.numel() for p in model.parameters()))} parameters, "
          f"{args.dtype}), {layout} = {args.pp * args.dp * args.cp * args.tp} ranks, "
          f"shard={shard!r}, {f'{schedule} schedule, ' if args.pp > 1 else ''}"
          f"{m} micro-batch{'es' if m > 1 else ''} of "
          f"{(args.batch or m) // m} x {args.seq} tokens, priced as {args.device}"
          + (f"; each peak includes the {size(RUNTIME['nccl'])} a CUDA process holds beyond any tensor (cuBLAS's "
             "workspaces)" if args.device == "cuda" else ""), flush=True)
    t0 = time.perf_counter()
    backend = "nccl" if args.device == "cuda" else "gloo"
    roles = dry_run(model, _lm_loss, pp=args.pp, dp=args.dp, cp=args.cp, tp=args.tp, batch=args.batch or m, seq=args.seq,
                    split_points=split_points or (), shard=shard, device=args.device, backend=backend,
                    microbatches=m, schedule=schedule, bucket_mb=args.bucket_mb,
                    progress=lambda s: print(s, flush=True))
    for r in roles:
        print(describe(r))
    print(f"dry run: {time.perf_counter() - t0:.0f} s; largest peak {size(max(r.peak for r in roles))} "
          f"({'pipeline rank' if roles[0].stages else 'stage'} {max(roles, key=lambda r: r.peak).stage})")
    if args.plot:
        from gradsched.sizing.plot import plot_roles
        plot_roles(roles, args.plot, parse_bytes(args.device_memory), f"{name}: {layout}, "
                   f"shard={shard!r}, {m} micro-batches, {args.seq} tokens, priced as {args.device}")
    if args.json:
        with open(args.json, "w") as f:
            for r in roles:
                f.write(json.dumps({"bench": "dryrun", "model": name, "pp": args.pp, "dp": args.dp,
                                    "cp": args.cp, "tp": args.tp, "shard": args.shard, "seq": args.seq, "microbatches": m,
                                    "schedule": schedule if args.pp > 1 else None, "dtype": args.dtype,
                                    **dataclasses.asdict(r)}) + "\n")
    return 0


@dataclasses.dataclass(frozen=True)
class Cut:
    """build(layers, checkpointing) -> (model on meta, its layers): a built-in Llama (`model`) or a Hugging Face
    config (`config`) cut to `layers` layers. Plain data: the fit's probes take it to their own processes."""
    model: str | None
    config: str | None
    dtype: torch.dtype
    tie: bool = False

    def __call__(self, layers, checkpointing):
        if self.config:
            return from_config(self.config, self.dtype, self.tie, checkpointing, layers)
        return llama(self.model, self.dtype, self.tie, checkpointing, layers)


@dataclasses.dataclass(frozen=True)
class Probe:
    """gradsched.sizing.fit's measure: build(layers, checkpointing) -> (model on meta, layers); each call dry-runs
    two stages of `layers` each (micro-batches of `seqs` sequences, one unless said; at tp), and returns for both stages
    (saved, the rest of the transient, accumulating, final_backward, stash): what the first forward left alive, the
    most the step held above that, the backwards' peaks above their micro-batches in flight, and under zb1p what
    a B kept for its W (Role). Plain data (with a `build` that pickles, e.g. Cut): it runs in other processes."""
    build: object
    seq: int
    device: str
    backend: str
    options: dict

    def __call__(self, layers, seqs, cp, checkpointing, shard, microbatches=1, schedule="auto", tp=1):
        roles = dry_run(self.build(2 * layers, checkpointing)[0], _lm_loss, pp=2, dp=2, cp=cp, tp=tp,
                        batch=seqs * microbatches, seq=self.seq, split_points=even_split_points(2 * layers, 2),
                        shard=shard, device=self.device, backend=self.backend, microbatches=microbatches,
                        schedule=schedule, progress=lambda s: None, **self.options)
        return [(r.saved, r.transient - r.saved, r.accumulating, r.final_backward, r.stash)
                for r in (roles[0], roles[-1])]


def probe(build, seq: int, device: str, backend: str, **options) -> Probe:
    return Probe(build, seq, device, backend, options)


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


if __name__ == "__main__":
    sys.exit(main())
