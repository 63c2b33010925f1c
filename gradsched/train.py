"""Train a Hugging Face causal LM with gradsched: the training entry point.

One node, 8 processes (GPUs, or CPU processes with gloo):
    torchrun --standalone --nproc-per-node 8 -m gradsched.train --model llama-tiny --data tokens.bin \\
        --pp 2 --cp 2 --batch 16 --seq 1024 --microbatches 4 --steps 1000 --lr 3e-4 --warmup 100 \\
        --clip 1.0 --ckpt ckpt --save-every 200 --metrics metrics.jsonl
Several nodes: the same command on each node with torchrun's rendezvous instead of --standalone:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m gradsched.train ...
Resume: add --resume ckpt (the newest complete checkpoint there) or --resume ckpt/step-00000200. The
checkpoint does not depend on the layout: --pp/--cp/--tp and the world size may change.
One node without torchrun: python -m gradsched.train --nproc-per-node 8 ... starts the processes itself
(and without --nproc-per-node, one process).

The model comes from a config: a built-in name (BUILTIN), or a local directory or JSON file of a
Hugging Face config (a directory that also holds weights starts from them). The data is a flat
binary file of token ids (uint16, or uint32 with --ids uint32), as nanoGPT prepares them; each
step reads the next `batch` windows of seq + 1 tokens, so the data position is the step. Without
--data, a built-in synthetic stream (a fixed random affine recurrence per sequence) that a model can learn.
dp is what is left of the world after pp x cp x tp. The rank that holds the loss (the last stage's
first rank) shows progress and writes the metrics, one JSON object per step.

A mistake of the user's (the plan, the data, the model, the checkpoint) ends the run with one line
from rank 0 on stderr and exit code 2, no traceback (--debug keeps the tracebacks). What a rank can check
alone (the command line against WORLD_SIZE, the files, the data against the model's vocabulary, the
checkpoint's state) every rank checks before connecting; what needs the process group (a checkpoint against
the model) ends every rank together. A run's ranks leave together, rank 0 (the host of the job's store) last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from gradsched.launch import free_port, launch_command, leave
from gradsched.plan import plan_sizes
from gradsched.sync.watchdog import CollectiveFault
from gradsched.sync.watchdog import stop as stop_watchdog
from gradsched.training.pipeline_schedule import SCHEDULES, resolve_schedule, stage_assignment
from gradsched.training.run_io import Mistake, Progress, Synthetic, TokenFile, lr_scale, open_metrics

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


def rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


# ---- the model ------------------------------------------------------------------------------

def build_model(spec: str, seed: int):
    """(gradsched.hf.CausalLM, its number of decoder layers) from a built-in name, a config JSON or a directory."""
    from gradsched.hf import CausalLM, require_transformers
    try:
        require_transformers(f"--model {spec}")
    except ModuleNotFoundError as e:
        raise Mistake(str(e)) from None
    import transformers
    torch.manual_seed(seed)
    path = Path(spec)
    if spec in BUILTIN:
        cls, kwargs = BUILTIN[spec]
        config = getattr(transformers, cls)(bos_token_id=0, eos_token_id=0, **kwargs)
    elif path.is_file():
        d = json.loads(path.read_text())
        if "model_type" not in d:
            raise Mistake(f"--model {spec}: a config JSON needs its 'model_type' (e.g. \"llama\").")
        config = transformers.AutoConfig.for_model(**d)
    elif path.is_dir():
        config = transformers.AutoConfig.from_pretrained(path)
    else:
        raise Mistake(f"--model {spec!r}: not a built-in ({', '.join(BUILTIN)}), a config JSON file or a "
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
        raise Mistake(f"{pp} pipeline stages need at least {pp} decoder layers; the model has {layers}.")
    stacks = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if not stacks:
        raise Mistake("cannot find the model's decoder layers (a ModuleList of num_hidden_layers modules) "
                         "to split it into pipeline stages: train it with --pp 1.")
    return [f"{stacks[0]}.{k * layers // pp}" for k in range(1, pp)]


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---- the run --------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors rank 0 alone prints, in the one line of every mistake (every rank parses the
    same command line)."""

    def error(self, message):
        if rank0():
            print(f"gradsched.train: error: {' '.join(message.split())} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def parse(argv=None):
    ap = _Parser(prog="python -m gradsched.train", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="llama-tiny", help=f"built-in ({', '.join(BUILTIN)}), config JSON or directory")
    ap.add_argument("--data", help="flat binary file of token ids; without it, a built-in synthetic stream")
    ap.add_argument("--ids", default="uint16", choices=("uint16", "uint32"), help="the token ids' type in --data")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (dp is the rest of the world)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (each layer split over them, inside a node)")
    ap.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--microbatches", type=int, default=1, help="per step, per data-parallel rank")
    ap.add_argument("--schedule", default="auto", choices=SCHEDULES,
                    help="the pipeline's schedule under --pp > 1 (auto: 1f1b, or gpipe with fewer micro-batches "
                         "than stages; zb1p: zero bubble, the backward split into B and W; interleaved_1f1b: two "
                         "stages a rank, looped; zbv: two stages a rank in a V, the first and last on rank 0; dualpipev: "
                         "DualPipe in the same V)")
    ap.add_argument("--split", default="even", choices=("even", "balanced"),
                    help="where pipeline stages begin (--pp > 1): even, the same number of decoder layers a stage; "
                         "balanced, where each rank's stages take the same time, timed on this device before the "
                         "first step, compiled by --compiler (gradsched.balanced_split_points: the head and the "
                         "embedding count)")
    ap.add_argument("--shard", default="true", choices=("true", "params", "false"),
                    help="true: gradients and optimizer state as each data-parallel rank's shard (a distributed "
                         "optimizer); params: the parameters too, gathered in the graphs before use (ZeRO-3 / FSDP); "
                         "false: gradients all-reduced, every rank whole")
    ap.add_argument("--seq", type=int, default=128, help="sequence length, in tokens")
    ap.add_argument("--steps", type=int, default=100, help="train up to this step")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate, reached at the end of --warmup")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decay's end, as a fraction of --lr")
    ap.add_argument("--warmup", type=int, default=10, help="steps of linear warmup")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="on matrices; biases and norms are decay-free")
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient norm; 0: no clipping")
    ap.add_argument("--on-nonfinite", default="raise", choices=("raise", "skip"),
                    help="a step whose loss or gradients went non-finite on any rank: end the run naming where "
                         "(exit code 3), or skip the step on every rank (counted in the progress line and metrics)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameters and compute")
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "eager"), help="torch.compile backend")
    ap.add_argument("--ckpt", help="checkpoint directory (gradsched.save)")
    ap.add_argument("--save-every", type=int, default=0, help="steps between checkpoints; 0: at the end only")
    ap.add_argument("--resume", help="a checkpoint directory (its newest) or one checkpoint")
    ap.add_argument("--metrics", help="JSON lines, one per step; a run from step 0 starts the file anew, a "
                                      "resumed run keeps the rows before its start")
    ap.add_argument("--log-every", type=int, default=1, help="steps between progress lines when not on a terminal")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and synthetic data")
    ap.add_argument("--nproc-per-node", type=int, default=1,
                    help="without torchrun: start this many processes on this machine")
    ap.add_argument("--debug", action="store_true", help="tracebacks for mistakes too, on every rank")
    args = ap.parse_args(argv)
    if args.save_every and not args.ckpt:
        ap.error("--save-every needs --ckpt")
    if args.split == "balanced" and args.pp == 1:
        ap.error("--split balanced places pipeline stages: give --pp 2 or more (one stage has nothing to balance)")
    for name in ("steps", "batch", "seq", "microbatches", "log_every", "nproc_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def quiet_libraries() -> None:
    """Silence, once per process, the warnings of libraries that say nothing a user of this entry point can act
    on: pipelining's pytree FutureWarning (raised while it sends stage metadata, on every rank), and DCP's
    note that a one-process run (no process group) loads in one process."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)


def warn(message: str) -> None:
    if rank0():
        print(f"gradsched.train: warning: {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """Run the command line; returns the exit code: 0, or 2 after one line naming a user's mistake."""
    import gradsched
    args = parse(argv)
    if "RANK" not in os.environ and args.nproc_per_node > 1:
        return launch_command(args.nproc_per_node, ["-m", "gradsched.train", *(sys.argv[1:] if argv is None else argv)])
    if "RANK" not in os.environ:  # one process, no launcher: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    quiet_libraries()
    try:
        return train(args)
    except (Mistake, gradsched.PlanError, gradsched.CheckpointError, CollectiveFault, gradsched.NonFiniteError) as e:
        if args.debug:
            raise
        if isinstance(e, CollectiveFault) or isinstance(e.__cause__, CollectiveFault):
            return fault(e)
        return refuse(e, 3 if isinstance(e, gradsched.NonFiniteError) else 2)
    except Exception as e:  # a model tensor parallelism cannot split, found as its graph compiles (Dynamo wraps it)
        from gradsched.passes.tp_layouts import TensorParallelError
        found = next((x for x in (e, e.__cause__, e.__context__) if isinstance(x, TensorParallelError)), None)
        if args.debug or found is None:
            raise
        return refuse(found)


def refuse(e: Exception, code: int = 2) -> int:
    """One line on rank 0 (every rank found the same mistake: each decides from the same command line,
    files and checkpoint; or the same non-finite step), then exit code `code` on every rank (2; 3 for a
    non-finite step). A mistake found before connecting (train checks
    all it can first) ends each rank alone; one found once the process group runs ends the ranks together
    (leave): none tears its connections down while a peer still uses them, and rank 0, the store's host,
    goes last."""
    if rank0():
        print(f"gradsched.train: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    leave()
    return code


def fault(e: Exception) -> int:
    """Another rank failed or stalled: every surviving rank says, in one line, where it was and which rank
    it names (its journal's last entries follow with --debug), then exit code 3. The watchdog is stopped
    first: no store call (and no TCPStore error of a store whose host is gone) follows the line."""
    stop_watchdog()
    first = str(e).split("This rank's last entries:")[0]
    rank = os.environ.get("RANK", "0")
    print(f"gradsched.train: rank {rank}: {' '.join(first.split())}", file=sys.stderr, flush=True)
    return 3


def check_alone(args, world: int) -> None:
    """The mistakes of the command line a rank finds alone, from WORLD_SIZE and the file system: every rank
    finds the same, before any connection (a rank that left while its peers were still connecting failed
    them in gloo, and rank 0's line could be lost). The checkpoint's, the model's and the data's checks
    follow in train, before connecting too."""
    dp = plan_sizes(world, args.pp, args.cp, tp=args.tp)
    if args.batch % (dp * args.microbatches):
        raise Mistake(f"--batch {args.batch} must divide into dp={dp} x --microbatches {args.microbatches}.")
    try:
        resolve_schedule(args.schedule, args.pp, args.microbatches)
    except ValueError as e:
        raise Mistake(f"--schedule {args.schedule} with --pp {args.pp} and --microbatches {args.microbatches}: {e}") \
            from None
    if args.cp > 1 and args.seq % (2 * args.cp):
        raise Mistake(f"--seq {args.seq} must divide into 2 x --cp {args.cp} = {2 * args.cp} equal chunks (each "
                      "context-parallel rank holds one from each end of a sequence): choose a --seq that is a "
                      f"multiple of {2 * args.cp}, or another --cp.")
    if args.ckpt:
        _writable_dir("--ckpt", args.ckpt)
    if args.metrics:
        _writable_file("--metrics", args.metrics)


def _writable_dir(flag: str, path: str) -> None:
    """A directory the run makes (with its parents) and writes, or one that exists and is writable."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise Mistake(f"{flag} {path}: a file, not a directory.")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise Mistake(f"{flag} {path}: {existing} is a file, not a directory.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise Mistake(f"{flag} {path}: {existing} is not writable.")


def _writable_file(flag: str, path: str) -> None:
    """A file the run writes (one rank only: said here by every rank, before connecting)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise Mistake(f"{flag} {path}: a directory; give a file name.")
    if not os.path.isdir(parent):
        raise Mistake(f"{flag} {path}: the directory {parent} does not exist.")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise Mistake(f"{flag} {path}: {'the file' if os.path.exists(path) else parent} is not writable.")


def train(args) -> int:
    import gradsched
    from gradsched.training.checkpoint import checkpoint_dir
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # every mistake a rank can find alone, before any connection: the plan against the world, the batch, the
    # places written, the checkpoint's state (none, partial, foreign...), the model, the data against its vocabulary
    check_alone(args, int(os.environ["WORLD_SIZE"]))
    resume_from = checkpoint_dir(args.resume) if args.resume else None
    model, layers = build_model(args.model, args.seed)
    schedule = resolve_schedule(args.schedule, args.pp, args.microbatches)
    stages, _ = stage_assignment(schedule, None)
    points = split_points(model, layers, args.pp * stages)  # zbv, interleaved_1f1b: two stages a rank
    vocab = model.model.config.vocab_size
    data = (TokenFile(args.data, args.ids, args.seq, vocab, args.batch) if args.data
            else Synthetic(args.seq, vocab, args.seed))
    if args.warmup > args.steps:
        warn(f"--warmup {args.warmup} is longer than the run (--steps {args.steps}): the learning rate never "
             f"reaches --lr {args.lr:g} (it peaks at {args.lr * args.steps / args.warmup:.3g}).")
    plan = gradsched.ParallelPlan.from_world(pp=args.pp, cp=args.cp, tp=args.tp)  # connects
    # from_world has set this process's GPU from LOCAL_RANK under NCCL
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    if args.split == "balanced" and points:  # every rank times the pieces; all take rank 0's choice
        x, y = (t.to(device) for t in data.batch(0, args.batch))
        mb = max(1, args.batch // plan.dp // args.microbatches)
        stack = points[0].rsplit(".", 1)[0]
        points = list(gradsched.balanced_split_points(model, (x[:mb],), y[:mb], next_token_loss,
                                                      [f"{stack}.{i}" for i in range(1, layers)], args.pp, schedule,
                                                      compiler=args.compiler,  # timed as the stages will run
                                                      microbatches=args.microbatches))
    model = gradsched.parallelize(model, plan=plan, loss_fn=next_token_loss,
                                  split_points=points,
                                  microbatches=args.microbatches, schedule=args.schedule, compiler=args.compiler,
                                  on_nonfinite=args.on_nonfinite,
                                  shard={"true": True, "params": "params", "false": False}[args.shard],
                                  **({"reduce_dtype": torch.float32} if args.dtype == "bfloat16" else {}))
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                         param_groups=gradsched.weight_decay_groups(args.weight_decay))
    start = gradsched.load(resume_from, model, opt)["data_position"] if resume_from else 0
    # the loss's rank (zbv: pipeline rank 0): the last stage's first replica, on TP rank 0
    reporter = model.num_stages - 1 in model.local and plan.rank == plan.first_replica() and plan.index("tp") == 0
    progress = Progress(args.steps, args.log_every) if reporter else None
    metrics = open_metrics(args.metrics, start) if reporter and args.metrics else None
    per, dp_idx = args.batch // plan.dp, plan.index("dp")
    if reporter:
        print(f"gradsched.train: {args.model}, {sum(p.numel() for p in model.model.parameters()):,} parameters, "
              f"pp={plan.pp} dp={plan.dp} cp={plan.cp}{f' tp={plan.tp}' if plan.tp > 1 else ''}"
              f"{f' ({model.schedule_name} schedule)' if plan.pp > 1 else ''}, "
              f"{f'shard={args.shard}, ' if args.shard != 'true' else ''}"
              f"{f'stages begin at {points}, ' if plan.pp > 1 else ''}"
              f"steps {start + 1}..{args.steps}", flush=True)
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
                   "tokens_per_s": args.batch * args.seq / dt, "skipped_steps": opt.skipped_steps}
            progress.show(row)
            if metrics:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
    if args.ckpt and not (args.save_every and args.steps % args.save_every == 0) and args.steps > start:
        gradsched.save(args.ckpt, model, opt, step=args.steps)
    if metrics:
        metrics.close()
    leave()  # every rank together, rank 0 (the store's host) last: no store call meets a store that is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
