"""Train a tied GPT (tiny, or Hugging Face GPT-2 / Llama) under torchrun: the README's example.

    torchrun --nproc-per-node 8 examples/train.py --model hf_llama --pp 2 --cp 2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/train.py --model hf_gpt2 --pp 2 --cp 2 --microbatches 4

The plan is built from torchrun's environment; dp is whatever is left of the world.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from gradsched.plan import init_from_env
from tied_training import Job, rank_main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny_gpt", choices=("tiny_gpt", "hf_gpt2", "hf_llama"))
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--mode", default="tied_first", choices=("tied_first", "shard_aligned"))
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_from_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // (args.pp * args.cp)
    job = Job(model=args.model, pp=args.pp, dp=dp, cp=args.cp, steps=args.steps,
              global_batch=4 * dp * args.microbatches,
              options={"compiler": args.compiler, "mode": args.mode, "microbatches": args.microbatches})
    out = rank_main(rank, world, job)
    if out["losses"][0] is not None and out["dp_idx"] == 0:
        print(f"rank {rank}: losses {[round(x, 5) for x in out['losses']]}", flush=True)
    if rank == 0:
        print(out["report"], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
