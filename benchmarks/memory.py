"""Memory per rank of data-parallel training, side by side: DDP, FSDP2 and gradsched's distributed
optimizer, on one tied model and the same batch per rank, one run.

    python benchmarks/memory.py --pp 1 --dp 4

Trains a GPT of about 30M parameters (dim 512, 8 layers, vocab 8192, tied embedding) with AdamW on
dp gloo processes (one thread each), once per implementation, and prints one JSON object each:

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
  peak_bytes_per_rank  measured: the rank's bytes alive at the start of the last step (counted as above)
                     plus the highest running sum of torch.profiler's CPU memory records over that step
                     (forward, backward, optimizer step); largest over ranks
  predicted_peak_bytes  null: the dry run that predicts it is still to come (issue 26)
  step_ms_median     median over steps after the first of the slowest rank, milliseconds. CPU, gloo, dp
                     ranks on 2 cores here: compare the ratios within one run only.
  max_abs_param_diff_vs_one_process  every parameter after the last step against the unsplit model
                     trained in one process on the global batch, with the same kernels: eager for DDP and
                     FSDP2, AOTAutograd's decomposed graphs for gradsched (its compiler="eager"), Inductor
                     for all with --compiler inductor. AdamW divides each gradient by its own size, so
                     kernels that round differently (eager against decomposed: 1.2e-4 here after two
                     steps, in one process, against 1.2e-7 with SGD) would hide what the distribution does.
"""
from __future__ import annotations

import argparse
import time

import torch

from common import RESULTS, emit, median_of_slowest  # benchmarks/common.py (the script's folder is on sys.path)
from gradsched.launch import run_ranks
from tied_training import Job, batch, build_model
from tiny_gpt import GPTConfig, lm_loss

CONFIG = GPTConfig(vocab=8192, seq=64, dim=512, heads=8, layers=8)
IMPLS = ("ddp", "fsdp2", "gradsched_optimizer", "gradsched_params")
LR, WEIGHT_DECAY = 1e-3, 0.1


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor's local shard)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def peak_increment(prof) -> int:
    """The highest running sum of the CPU memory records (each event's own allocations and frees)."""
    run = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        run += e.self_cpu_memory_usage
        peak = max(peak, run)
    return peak


class Trainer:
    """One implementation's model and optimizer behind three calls: step, held tensors, full parameters."""

    def __init__(self, impl: str, job: Job, compiler: str, bucket_mb: float = 25.0):
        import torch.distributed as dist
        model, _ = build_model(job)
        self.impl = impl
        if impl.startswith("gradsched"):
            import gradsched
            plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp)
            self.model = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, compiler=compiler,
                                               shard="params" if impl == "gradsched_params" else True,
                                               bucket_mb=bucket_mb,
                                               split_points=["blocks.4"] if job.pp > 1 else ())
            self.opt = gradsched.DistributedOptimizer(self.model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
            return
        if impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            # gradients as views of DDP's buckets: its lean setting, and the buckets are then reachable as .grad
            model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        elif impl == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
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


def rank_run(rank: int, world: int, impl: str, job: Job, compiler: str, bucket_mb: float) -> dict:
    from torch.profiler import ProfilerActivity, profile
    trainer = Trainer(impl, job, compiler, bucket_mb)
    per_rank = job.global_batch // job.dp
    dp_idx = trainer.model.plan.coords()[1] if impl.startswith("gradsched") else rank  # DDP, FSDP2: all dp
    times, state, peak = [], 0, 0
    for step in range(job.steps):
        x, y = batch(job, step)
        x, y = x[dp_idx * per_rank:(dp_idx + 1) * per_rank], y[dp_idx * per_rank:(dp_idx + 1) * per_rank]
        last = step == job.steps - 1
        at_start = storage_bytes(trainer.held()) if last else 0
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if last else _nothing() as prof:
            trainer.forward_backward(x, y)
            if last:
                state = storage_bytes(trainer.held())  # gradients reduced, the optimizer about to step
            trainer.step()
        times.append(time.perf_counter() - t0)
        if last:
            peak = at_start + peak_increment(prof)
    return {"step_times": times, "state_bytes": state, "peak_bytes": peak, "params": trainer.full_parameters()}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reference_params(job: Job, backend: str | None) -> dict:
    """The unsplit model trained in one process on the global batch, compiled with `backend` (None: eager)."""
    model, _ = build_model(job)
    forward = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(job.steps):
        x, y = batch(job, step)
        lm_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


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
    ap.add_argument("--batch-per-rank", type=int, default=2)
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="gradsched's bucket_mb (its default: 25)")
    ap.add_argument("--debug", action="store_true", help="print the parameters furthest from one process")
    ap.add_argument("--out", default=None, help="results file ('' for none); default benchmarks/results/"
                    "memory_pp{pp}_dp{dp}.jsonl")
    args = ap.parse_args(argv)
    out = args.out if args.out is not None else RESULTS / f"memory_pp{args.pp}_dp{args.dp}.jsonl"
    job = Job(pp=args.pp, dp=args.dp, steps=args.steps, global_batch=args.dp * args.batch_per_rank, config=CONFIG,
              optimizer="adamw", lr=LR)
    refs = {}
    numel = sum(p.numel() for n, p in build_model(job)[0].named_parameters())
    rows = []
    for impl in args.impl:
        if args.pp > 1 and not impl.startswith("gradsched"):
            print(f"memory.py: {impl} runs at pp 1 only; left out at pp {args.pp}")
            continue
        ranks = run_ranks(rank_run, args.pp * args.dp, impl, job, args.compiler, args.bucket_mb, timeout_s=1800)
        backend = same_kernels(impl, args.compiler)
        if backend not in refs:
            refs[backend] = reference_params(job, backend)
        ref = refs[backend]
        diffs = {n: (r["params"][n].float() - ref[n]).abs().max().item() for r in ranks for n in r["params"]}
        diff = max(diffs.values())
        if args.debug:
            print(sorted(diffs.items(), key=lambda kv: -kv[1])[:5])
        rows.append({"bench": "memory", "impl": impl, "pp": args.pp, "dp": args.dp, "compiler": args.compiler,
                     "bucket_mb": args.bucket_mb if impl.startswith("gradsched") else None,
                     "parameters": numel, "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
                     "state_bytes_whole": 16 * numel, "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
                     "predicted_peak_bytes": None,
                     "step_ms_median": round(1e3 * median_of_slowest(ranks), 1),
                     "max_abs_param_diff_vs_one_process": diff})
        emit(rows[-1:], out, append=len(rows) > 1)  # each as it is measured; the file starts anew
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
