"""Memory per rank of data-parallel training, side by side: DDP, FSDP2 and gradsched's distributed
optimizer, on one tied model and the same batch per rank, one run.

    python benchmarks/memory.py --pp 1 --dp 4

Trains a GPT of about 30M parameters (dim 512, 8 layers, vocab 8192, tied embedding) with AdamW on
dp gloo processes (one thread each), once per implementation, and prints one JSON object each:

  --device cuda      one GPU cannot hold dp NCCL ranks: rank 0 of each implementation is played in this one
                     process on torch's fake process group (collectives move nothing), so memory and compute
                     are the device's and nothing is communicated; no parameter check (pp 1 only). The rows
                     name the device and the world. --fake-world does the same on CPU.
  --pp 2 --schedule zbv --microbatches 4    gradsched alone, under a pipeline schedule (two stages a rank for
                     zbv, dualpipev, interleaved_1f1b), its peak beside the dry run's prediction for the same plan

  impl               ddp (torch DDP), fsdp2 (fully_shard per block and at the root, its defaults:
                     parameters resharded after forward), gradsched_optimizer (parallelize(shard=True):
                     whole parameters and gradients, fp32 masters and optimizer state sharded),
                     gradsched_params (parallelize(shard="params"): the parameters too live as shards,
                     all-gathered per bucket in the graphs, the backward gathering again)
  state_bytes_per_rank  parameters, gradients, fp32 master weights and optimizer state that the rank
                     holds when its optimizer steps (distinct storages counted once; a DTensor by its local
                     shard), largest over ranks. DDP's own gradient buckets are not reachable from the
                     model and are not counted here; they show in the peak.
  state_bytes_whole  the same for the whole model in one process: parameters, gradients and AdamW's
                     two moments (fp32: 16 bytes a parameter)
  peak_bytes_per_rank  measured, largest over ranks. CPU: the rank's bytes alive at the start of the last
                     step (counted as above) plus the most bytes alive above that over the step (forward,
                     backward, optimizer step), counted by a CPU allocator that sees every thread's
                     allocations and frees (benchmarks/cpu_peak.py; torch.profiler's memory events miss
                     frees made on gloo's threads, which read as a peak too high by up to a bucket). CUDA: torch.cuda.max_memory_allocated over the last step, which also counts what
                     the rank holds beyond its training state (cuBLAS's workspaces, a library's buffers)
  predicted_peak_bytes  gradsched's rows: the dry run's (gradsched.dryrun) peak for this plan, from the model
                     built on the meta device in this one process, over torch's fake process group; null for
                     DDP and FSDP2
  step_ms_median     median over steps after the first of the slowest rank, milliseconds. CPU, gloo, dp
                     ranks on 2 cores here: compare the ratios within one run only.
  max_abs_param_diff_vs_one_process  every parameter after the last step against the unsplit model
                     trained in one process on the global batch, with the same kernels: eager for DDP and
                     FSDP2, AOTAutograd's decomposed graphs for gradsched (its compiler="eager"), Inductor
                     for all with --compiler inductor. AdamW divides each gradient by its own size, so
                     kernels that round differently (eager against decomposed: 1.2e-4 here after two
                     steps, in one process, against 1.2e-7 with SGD) would hide what the distribution does.
                     For the same reason two fp32 runs that sum in different orders differ at lr scale
                     where a gradient nearly cancels, whichever is nearer the exact answer; so also:
  max_abs_param_err_vs_fp64  every parameter after the last step against the unsplit model trained in one
                     process in float64 (eager): the error of the run
  one_process_max_abs_param_err_vs_fp64  the same for the one-process fp32 run above (its kernels): the
                     error a single device makes. A ratio near 1 says the distribution adds no error.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

import cpu_peak  # benchmarks/cpu_peak.py: every thread's allocations and frees
from common import RESULTS, emit, median_of_slowest  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from gradsched.training.live_bytes import storage_bytes as live_storage_bytes
from tied_training import Job, abs_diff, batch, build_model
from tiny_gpt import GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=8192, seq=64, dim=512, heads=8, layers=8)
IMPLS = ("ddp", "fsdp2", "gradsched_optimizer", "gradsched_params")
LR, WEIGHT_DECAY = 1e-3, 0.1


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor's local shard)."""
    return live_storage_bytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)


def optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class Trainer:
    """One implementation's model and optimizer behind three calls: step, held tensors, full parameters."""

    def __init__(self, impl: str, job: Job, compiler: str, bucket_mb: float = 25.0, device: str = "cpu"):
        import torch.distributed as dist
        model, _ = build_model(job)
        model = model.to(device)
        self.impl = impl
        if impl.startswith("gradsched"):
            import gradsched
            plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp)
            self.model = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, compiler=compiler,
                                               shard="params" if impl == "gradsched_params" else True,
                                               bucket_mb=bucket_mb, split_points=split_points(job),
                                               schedule=job.schedule, microbatches=job.options.get("microbatches", 1),
                                               # a fake world has no peers to agree with
                                               check_ranks=dist.get_backend() != "fake")
            self.opt = gradsched.DistributedOptimizer(self.model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
            return
        if impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            # gradients as views of DDP's buckets: its lean setting, and the buckets are then reachable as .grad
            model = DistributedDataParallel(model, gradient_as_bucket_view=True)
            if dist.get_backend() == "fake":  # the fake group's futures hold None, which DDP's reducer refuses
                model.register_comm_hook(None, _fake_all_reduce_hook)
        elif impl == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh(device, (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            raise ValueError(f"unknown impl {impl!r}: one of {IMPLS}")
        self.model = model
        self.forward = torch.compile(model) if compiler == "inductor" else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def forward_backward(self, x, y) -> None:
        if self.impl.startswith("gradsched"):
            self.model.train_step(x, y)
        else:
            lm_loss(self.forward(x), y).backward()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.impl != "ddp")  # DDP's buckets stay (as its .grad views)

    def held(self) -> list:
        """Every tensor of training state the rank holds now."""
        if self.impl.startswith("gradsched"):
            sync, inner = self.model.grad_sync, self.opt.optimizer
            reduced = list(sync.reduced()) if sync.sync_plan.shard else []
            shards = list(sync.param_shards.shards.values()) if sync.param_shards is not None else []
            # under shard="params" the parameters' own storage is released (0 bytes) and the shards hold them
            return [p for p in sync.params.values()] + [p.grad for p in sync.params.values()] + reduced + shards + \
                list(getattr(self.opt, "masters", [])) + (optimizer_tensors(inner) if inner is not None else [])
        params = list(self.model.parameters())
        return params + [p.grad for p in params] + optimizer_tensors(self.opt)

    def full_parameters(self) -> dict:
        if self.impl.startswith("gradsched"):
            return self.model.state_dict()
        module = self.model.module if self.impl == "ddp" else self.model
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in module.named_parameters(remove_duplicate=False)}


def _fake_all_reduce_hook(state, bucket):
    import torch.distributed as dist
    dist.all_reduce(bucket.buffer())
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def rank_run(rank: int, world: int, impl: str, job: Job, compiler: str, bucket_mb: float,
             device: str = "cpu") -> dict:
    cuda = device == "cuda"
    if not cuda:
        cpu_peak.install()  # before the model: the CPU allocator then counts every thread's frees
    trainer = Trainer(impl, job, compiler, bucket_mb, device)
    per_rank = job.global_batch // job.dp
    dp_idx = trainer.model.plan.index("dp") if impl.startswith("gradsched") else rank  # DDP, FSDP2: all dp
    times, state, peak = [], 0, 0
    for step in range(job.steps):
        x, y = batch(job, step)
        x, y = x[dp_idx * per_rank:(dp_idx + 1) * per_rank], y[dp_idx * per_rank:(dp_idx + 1) * per_rank]
        x, y = x.to(device), y.to(device)
        last = step == job.steps - 1
        at_start = storage_bytes(trainer.held()) if last and not cuda else 0
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif last:
            cpu_peak.reset()
        t0 = time.perf_counter()
        trainer.forward_backward(x, y)
        if last:
            state = storage_bytes(trainer.held())  # gradients reduced, the optimizer about to step
        trainer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if last:
            peak = torch.cuda.max_memory_allocated() if cuda else at_start + cpu_peak.peak()
    return {"step_times": times, "state_bytes": state, "peak_bytes": peak,
            "params": trainer.full_parameters() if not cuda else {}}


def fake_world_run(impl: str, job: Job, compiler: str, bucket_mb: float, device: str) -> list[dict]:
    """Rank 0 of each pipeline stage's data-parallel group, played in this one process on torch's fake process
    group (collectives move nothing): the per-rank memory of a dp-wide job on one device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    ranks = []
    for stage in range(job.pp):
        dist.init_process_group("fake", store=FakeStore(), rank=stage * job.dp, world_size=job.pp * job.dp)
        try:
            torch._dynamo.reset()
            gc.collect()  # the previous implementation's tensors (cycles through its sync) go first
            if device == "cuda":
                torch.cuda.empty_cache()
            ranks.append(rank_run(stage * job.dp, job.pp * job.dp, impl, job, compiler, bucket_mb, device))
        finally:
            dist.destroy_process_group()
    return ranks


def split_points(job: Job) -> list[str]:
    """Half the blocks a stage; under a schedule of two stages a rank, a quarter."""
    stages = job.pp * (2 if job.schedule in ("zbv", "dualpipev", "interleaved_1f1b") else 1)
    return [f"blocks.{i * job.config.layers // stages}" for i in range(1, stages)]


def predicted_peak(impl: str, job: Job, batch_per_rank: int, bucket_mb: float, backend: str,
                   device: str) -> int | None:
    """The dry run's peak for gradsched's implementations (the largest over stages), attention priced as
    `device` runs it."""
    if not impl.startswith("gradsched"):
        return None
    from gradsched.dryrun import dry_run
    from tiny_gpt import TinyGPT
    with torch.device("meta"):
        model = TinyGPT(job.config)
    roles = dry_run(model, lm_loss, pp=job.pp, dp=job.dp, cp=1, batch=batch_per_rank, seq=job.config.seq,
                    split_points=split_points(job), schedule=job.schedule, microbatches=job.options.get("microbatches", 1),
                    optimizer_kwargs={"lr": LR, "weight_decay": WEIGHT_DECAY}, progress=lambda s: None, backend=backend, device=device,
                    shard="params" if impl == "gradsched_params" else True, bucket_mb=bucket_mb)
    return max(r.peak for r in roles)


def reference_params(job: Job, backend: str | None, dtype: torch.dtype = torch.float32) -> dict:
    """The unsplit model trained in one process on the global batch, compiled with `backend` (None: eager),
    in `dtype` (float64: the exact answer's stand-in)."""
    model, _ = build_model(job)
    model = model.to(dtype)
    forward = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(job.steps):
        x, y = batch(job, step)
        lm_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def max_abs_diff(runs: list[dict], ref: dict) -> float:
    """Max |run - ref| over every parameter of every run; inf if either side holds a NaN or an inf."""
    return max(abs_diff(run[n].double(), ref[n].double()) for run in runs for n in run)


def same_kernels(impl: str, compiler: str) -> str | None:
    """The one-process backend that runs the kernels `impl` runs."""
    if compiler == "inductor":
        return "inductor"
    return "aot_eager_decomp_partition" if impl.startswith("gradsched") else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (gradsched only: DDP and FSDP2 run at pp 1)")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--schedule", default="auto", help="gradsched's pipeline schedule (pp > 1), e.g. zbv")
    ap.add_argument("--microbatches", type=int, default=1, help="gradsched's micro-batches a step")
    ap.add_argument("--batch-per-rank", type=int, default=2)
    ap.add_argument("--seq", type=int, default=CONFIG.seq, help="tokens per sequence (attention's share of the "
                    "peak grows with it: the dry run's pricing of the device's kernel is checked at two lengths)")
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--bucket-mb", type=float, default=None, help="gradsched's bucket_mb; default: one block's "
                    "parameters (12.0 MiB), the unit FSDP2 gathers and reduces here (gradsched's own default: 25)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: one device, so each rank is played in this process on a fake process group")
    ap.add_argument("--fake-world", action="store_true", help="play rank 0 on a fake process group in this "
                    "process, as --device cuda does (no communication: no parameter check; pp 1)")
    ap.add_argument("--debug", action="store_true", help="print the parameters furthest from one process")
    ap.add_argument("--out", default=None, help="results file ('' for none); default benchmarks/results/"
                    "memory_pp{pp}_dp{dp}.jsonl")
    args = ap.parse_args(argv)
    fake = args.fake_world or args.device == "cuda"
    if fake and args.pp > 1:
        ap.error("--device cuda / --fake-world play one rank in one process: pp 1 only (a pipeline's stages "
                 "would need their peers)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    suffix = "_cuda" if args.device == "cuda" else "_fake" if fake else ""
    out = args.out if args.out is not None else RESULTS / f"memory_pp{args.pp}_dp{args.dp}{suffix}.jsonl"
    job = Job(pp=args.pp, dp=args.dp, steps=args.steps, global_batch=args.dp * args.batch_per_rank,
              config=dataclasses.replace(CONFIG, seq=args.seq),
              optimizer="adamw", lr=LR, schedule=args.schedule, options={"microbatches": args.microbatches})
    if args.bucket_mb is None:  # one block, as FSDP2 is wrapped: both move the same bytes at a time
        block = build_model(job)[0].blocks[0]
        args.bucket_mb = sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20
    if not args.device == "cuda":
        cpu_peak.build()  # compiled once here, before the ranks load it
    refs, exact = {}, None
    numel = sum(p.numel() for n, p in build_model(job)[0].named_parameters())
    rows = []
    for impl in args.impl:
        if args.pp > 1 and not impl.startswith("gradsched"):
            print(f"memory.py: {impl} runs at pp 1 only; left out at pp {args.pp}")
            continue
        if fake:
            ranks, diff = fake_world_run(impl, job, args.compiler, args.bucket_mb, args.device), None
            err = one_err = None
        else:
            ranks = run_ranks(rank_run, args.pp * args.dp, impl, job, args.compiler, args.bucket_mb, timeout_s=1800)
            backend = same_kernels(impl, args.compiler)
            if backend not in refs:
                refs[backend] = reference_params(job, backend)
            ref = refs[backend]
            diffs = {n: abs_diff(r["params"][n].float(), ref[n]) for r in ranks for n in r["params"]}
            diff = max(diffs.values())
            if exact is None:
                exact = reference_params(job, None, torch.float64)
            err = max_abs_diff([r["params"] for r in ranks], exact)
            one_err = max_abs_diff([ref], exact)
            if args.debug:
                print(sorted(diffs.items(), key=lambda kv: -kv[1])[:5])
        rows.append({"bench": "memory", "impl": impl, "pp": args.pp, "dp": args.dp, "seq": args.seq, "compiler": args.compiler,
                     **({"schedule": args.schedule, "microbatches": args.microbatches} if args.pp > 1 else {}),
                     "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                     "world": "fake (rank 0 in one process, no communication)" if fake else "gloo processes",
                     "bucket_mb": args.bucket_mb if impl.startswith("gradsched") else None,
                     "parameters": numel, "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
                     "state_bytes_whole": 16 * numel, "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
                     "predicted_peak_bytes": predicted_peak(impl, job, args.batch_per_rank, args.bucket_mb,
                                                            "nccl" if args.device == "cuda" else "fake" if fake else "gloo",
                                                            args.device),
                     "step_ms_median": round(1e3 * median_of_slowest(ranks), 1),
                     "max_abs_param_diff_vs_one_process": diff,
                     "max_abs_param_err_vs_fp64": err, "one_process_max_abs_param_err_vs_fp64": one_err})
        emit(rows[-1:], out, append=len(rows) > 1)  # each as it is measured; the file starts anew
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
