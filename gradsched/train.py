"""Train a Hugging Face causal LM with gradsched: the training entry point.

One node, 8 processes (GPUs, or CPU processes with gloo):
    torchrun --standalone --nproc-per-node 8 -m gradsched.train --model llama-tiny --data tokens.bin \\
        --pp 2 --cp 2 --batch 16 --seq 1024 --microbatches 4 --steps 1000 --lr 3e-4 --warmup 100 \\
        --clip 1.0 --ckpt ckpt --save-every 200 --metrics metrics.jsonl
Several nodes: the same command on each node with torchrun's rendezvous instead of --standalone:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m gradsched.train ...
Resume: add --resume ckpt (the newest complete checkpoint there) or --resume ckpt/step-00000200. The
checkpoint does not depend on the layout: --pp/--cp and the world size may change.

The model comes from a config: a built-in name (BUILTIN), or a local directory or JSON file of a
Hugging Face config (a directory that also holds weights starts from them). The data is a flat
binary file of token ids (uint16, or uint32 with --ids uint32), as nanoGPT prepares them; each
step reads the next `batch` windows of seq + 1 tokens, so the data position is the step. Without
--data, a built-in synthetic stream (a fixed random affine recurrence per sequence) that a model can learn.
dp is what is left of the world after pp x cp. The rank that holds the loss (the last stage's
first rank) shows progress and writes the metrics, one JSON object per step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BUILTIN = {  # name -> (HF config class, its arguments); every one ties its embedding and head
    "llama-tiny": ("LlamaConfig", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                       tie_word_embeddings=True)),
    "llama-20m": ("LlamaConfig", dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                                      tie_word_embeddings=True)),
    "gpt2-tiny": ("GPT2Config", dict(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=4096,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
}


# ---- the model ------------------------------------------------------------------------------

def build_model(spec: str, seed: int):
    """(gradsched.hf.CausalLM, its number of decoder layers) from a built-in name, a config JSON or a directory."""
    import transformers

    from gradsched.hf import CausalLM
    torch.manual_seed(seed)
    path = Path(spec)
    if spec in BUILTIN:
        cls, kwargs = BUILTIN[spec]
        config = getattr(transformers, cls)(bos_token_id=0, eos_token_id=0, **kwargs)
    elif path.is_file():
        d = json.loads(path.read_text())
        if "model_type" not in d:
            raise SystemExit(f"--model {spec}: a config JSON needs its 'model_type' (e.g. \"llama\").")
        config = transformers.AutoConfig.for_model(**d)
    elif path.is_dir():
        config = transformers.AutoConfig.from_pretrained(path)
    else:
        raise SystemExit(f"--model {spec!r}: not a built-in ({', '.join(BUILTIN)}), a config JSON file or a "
                         "directory holding config.json.")
    config._attn_implementation = "sdpa"
    has_weights = path.is_dir() and (any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").exists())
    if has_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"  # else GPT-2 logs a warning_once, which breaks fullgraph
    return CausalLM(model, documents=False), config.num_hidden_layers  # positions are 0..S-1: one document


def split_points(model: torch.nn.Module, layers: int, pp: int) -> list[str]:
    """Module names that begin stages 1..pp-1: the decoder layers cut into pp near-equal runs."""
    if pp == 1:
        return []
    if layers < pp:
        raise SystemExit(f"--pp {pp} needs at least {pp} decoder layers; the model has {layers}.")
    stacks = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if not stacks:
        raise SystemExit("cannot find the model's decoder layers (a ModuleList of num_hidden_layers modules) "
                         "to split it into pipeline stages: train it with --pp 1.")
    return [f"{stacks[0]}.{k * layers // pp}" for k in range(1, pp)]


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---- the data -------------------------------------------------------------------------------

class TokenFile:
    """A flat binary file of token ids, read as consecutive windows of seq + 1 tokens."""

    def __init__(self, path: str, ids: str, seq: int, vocab: int):
        import numpy as np
        self.tokens = np.memmap(path, dtype={"uint16": np.uint16, "uint32": np.uint32}[ids], mode="r")
        self.seq, self.windows = seq, (len(self.tokens) - 1) // seq
        if self.windows < 1:
            raise SystemExit(f"--data {path}: {len(self.tokens)} tokens, fewer than one window of --seq {seq} + 1.")
        top = int(self.tokens.max())
        if top >= vocab:
            raise SystemExit(f"--data {path} holds token id {top}, but the model's vocabulary has {vocab}: check "
                             "--ids (uint16 or uint32) and the model.")

    def batch(self, step: int, size: int):
        """Windows step*size .. step*size + size - 1 (wrapping around the file): (inputs, next tokens)."""
        rows = []
        for i in range(step * size, (step + 1) * size):
            at = (i % self.windows) * self.seq
            rows.append(torch.from_numpy(self.tokens[at:at + self.seq + 1].astype("int64")))
        w = torch.stack(rows)
        return w[:, :-1], w[:, 1:]


class Synthetic:
    """Sequences t[i+1] = (a * t[i] + c) mod vocab, with (a, c, t[0]) drawn per sequence from the
    sequence's index: learnable in-context, the same on every rank and at every layout."""

    def __init__(self, seq: int, vocab: int, seed: int):
        self.seq, self.vocab, self.seed = seq, vocab, seed

    def batch(self, step: int, size: int):
        rows = []
        for i in range(step * size, (step + 1) * size):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            a, c, t = (int(x) for x in torch.randint(1, self.vocab, (3,), generator=g, device="cpu"))
            seq = [t]
            for _ in range(self.seq):
                seq.append((a * seq[-1] + c) % self.vocab)
            rows.append(torch.tensor(seq, device="cpu"))  # host data; the step moves it
        w = torch.stack(rows)
        return w[:, :-1], w[:, 1:]


# ---- the schedule and the report --------------------------------------------------------------

def lr_scale(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio at `total` (step counts from 0)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Progress:
    """One line per step on a terminal (rewritten in place), every `every` steps in a log."""

    def __init__(self, total: int, every: int, out=sys.stdout):
        self.total, self.every, self.out, self.tty = total, every, out, out.isatty()

    def show(self, row: dict) -> None:
        done = row["step"]
        bar = "#" * int(20 * done / self.total)
        line = (f"step {done}/{self.total} [{bar:<20}] loss {row['loss']:.4f} lr {row['lr']:.2e} "
                f"{row['tokens_per_s']:,.0f} tok/s {row['step_s'] * 1000:.0f} ms/step")
        if self.tty:
            self.out.write("\r" + line + ("\n" if done == self.total else ""))
        elif done % self.every == 0 or done == self.total:
            self.out.write(line + "\n")
        self.out.flush()


# ---- the run --------------------------------------------------------------------------------

def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gradsched.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-tiny", help=f"built-in ({', '.join(BUILTIN)}), config JSON or directory")
    ap.add_argument("--data", help="flat binary file of token ids; without it, a built-in synthetic stream")
    ap.add_argument("--ids", default="uint16", choices=("uint16", "uint32"))
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100, help="train up to this step")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.1, help="on matrices; biases and norms are decay-free")
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient norm; 0: no clipping")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--ckpt", help="checkpoint directory (gradsched.save)")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", help="a checkpoint directory (its newest) or one checkpoint")
    ap.add_argument("--metrics", help="JSON lines, one per step")
    ap.add_argument("--log-every", type=int, default=10, help="progress lines when not on a terminal")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.save_every and not args.ckpt:
        ap.error("--save-every needs --ckpt")
    return args


def main(argv=None) -> int:
    import gradsched
    args = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    plan = gradsched.ParallelPlan.from_world(pp=args.pp, cp=args.cp)
    if args.batch % (plan.dp * args.microbatches):
        raise SystemExit(f"--batch {args.batch} must divide into dp={plan.dp} x --microbatches {args.microbatches}.")
    model, layers = build_model(args.model, args.seed)
    vocab = model.model.config.vocab_size
    data = TokenFile(args.data, args.ids, args.seq, vocab) if args.data else Synthetic(args.seq, vocab, args.seed)
    # from_world has set this process's GPU from LOCAL_RANK under NCCL
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    model = gradsched.parallelize(model, plan=plan, loss_fn=next_token_loss,
                                  split_points=split_points(model, layers, args.pp),
                                  microbatches=args.microbatches, compiler=args.compiler,
                                  **({"reduce_dtype": torch.float32} if args.dtype == "bfloat16" else {}))
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                         param_groups=gradsched.weight_decay_groups(args.weight_decay))
    try:
        start = gradsched.load(args.resume, model, opt)["data_position"] if args.resume else 0
    except gradsched.CheckpointError as e:
        raise SystemExit(f"--resume: {e}") from None
    _, dp_idx, cp_idx = plan.coords()
    reporter = plan.stage == args.pp - 1 and dp_idx == 0 and cp_idx == 0
    progress = Progress(args.steps, args.log_every) if reporter else None
    metrics = open(args.metrics, "a") if reporter and args.metrics else None
    per = args.batch // plan.dp
    if reporter:
        print(f"gradsched.train: {args.model}, {sum(p.numel() for p in model.model.parameters()):,} parameters, "
              f"pp={plan.pp} dp={plan.dp} cp={plan.cp}, steps {start + 1}..{args.steps}", flush=True)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = (t.to(device) for t in data.batch(step, args.batch))
        scale = lr_scale(step, args.warmup, args.steps, args.min_lr_ratio)
        loss = model.train_step(x[dp_idx * per:(dp_idx + 1) * per], y[dp_idx * per:(dp_idx + 1) * per])
        norm = gradsched.clip_grad_norm_(model, args.clip) if args.clip else None
        opt.step(lr_scale=scale)
        opt.zero_grad()
        dt = time.perf_counter() - t0
        if args.save_every and (step + 1) % args.save_every == 0:
            gradsched.save(args.ckpt, model, opt, step=step + 1)
        if reporter:
            row = {"step": step + 1, "loss": float(loss), "lr": args.lr * scale,
                   "grad_norm": None if norm is None else float(norm), "step_s": dt,
                   "tokens_per_s": args.batch * args.seq / dt}
            progress.show(row)
            if metrics:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
    if args.ckpt and not (args.save_every and args.steps % args.save_every == 0) and args.steps > start:
        gradsched.save(args.ckpt, model, opt, step=args.steps)
    if metrics:
        metrics.close()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
