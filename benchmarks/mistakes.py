"""A user's mistake is one line, every time: each mistake run many times on 4 processes.

    python benchmarks/mistakes.py                          # every mistake, 20 runs each
    python benchmarks/mistakes.py --repeats 3 --only pp_3_on_4 data_ids_beyond_vocab

Each run starts `python -m gradsched.train` on --nproc processes with torchrun's variables (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, one thread each), as `--nproc-per-node` and torchrun
do, and waits for every one of them (nothing is stopped early: a rank that would outlive the others
shows). What every rank can check alone is checked before any connection; a mistake found once the
process group runs (a checkpoint of another model) ends every rank together. A run is right when the
ranks' output, stdout and stderr of all of them, is exactly one line, `gradsched.train: error: ...`, from
rank 0, and every rank exits with code 2. One JSON object per mistake:

  mistake          its name (MISTAKES: what the user got wrong, and the arguments that do it)
  runs             how many times it was run
  same_line_runs   runs whose output was exactly the one line, the same line as the others' (the most common)
  exit_codes       {exit code: number of processes}, over every rank of every run
  line             the most common line
  tracebacks       runs with a Python traceback or a C++ stack ('frame #') anywhere in any rank's output
  other_outputs    up to 3 distinct outputs (rank: first lines) of the runs that were not the one line
  seconds          median seconds per run (start to the last rank's end)

and writes them to benchmarks/results/mistakes.jsonl.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--model", "llama-tiny", "--seq", "32", "--batch", "8", "--microbatches", "2", "--steps", "20",
        "--compiler", "eager"]

# name -> (what the user got wrong, the arguments added to BASE; {d} is a folder prepare() filled)
MISTAKES = {
    "pp_3_on_4": ("--pp 3 on 4 processes", ["--pp", "3"]),
    "pp_beyond_layers": ("--pp 4 for a model of 2 decoder layers", ["--pp", "4", "--model", "{d}/two_layers.json"]),
    "cp_3_on_4": ("--cp 3 on 4 processes", ["--cp", "3"]),
    "seq_not_split_by_cp": ("--cp 2 with a --seq that 2 x cp does not divide", ["--cp", "2", "--seq", "30"]),
    "zero_bubble_without_pipeline": ("--schedule zb1p without --pp", ["--schedule", "zb1p"]),
    "balanced_without_pipeline": ("--split balanced without --pp", ["--split", "balanced"]),
    "batch_not_divisible": ("--batch 6 over dp=4 x --microbatches 2", ["--batch", "6"]),
    "data_missing": ("--data naming no file", ["--data", "{d}/no_such_tokens.bin"]),
    "data_ids_beyond_vocab": ("token ids beyond the model's vocabulary (256)", ["--data", "{d}/ids_to_300.bin"]),
    "model_bad_path": ("--model naming no built-in, file or directory", ["--model", "{d}/no_such_model"]),
    "resume_nonexistent": ("--resume of a path that does not exist", ["--resume", "{d}/no_such_ckpt"]),
    "resume_partial": ("--resume of a directory holding only a partial save", ["--resume", "{d}/partial_ckpt"]),
    "save_every_without_ckpt": ("--save-every without --ckpt", ["--save-every", "5"]),
    "resume_other_model": ("--resume of a checkpoint of another model (found once the process group runs)",
                           ["--resume", "{d}/gpt2_ckpt"]),
}


def prepare(d: Path, names) -> None:
    """The files the mistakes name: a config of 2 layers, token ids up to 300, a partial save; and, for
    resume_other_model, a checkpoint of gpt2-tiny (a one-process run of one step)."""
    import numpy as np
    (d / "two_layers.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)))
    (np.arange(5000) % 301).astype(np.uint16).tofile(d / "ids_to_300.bin")
    (d / "partial_ckpt" / "step-00000002.partial").mkdir(parents=True, exist_ok=True)
    (d / "partial_ckpt" / "step-00000002.partial" / "__0_0.distcp").write_bytes(b"\0" * 64)
    if "resume_other_model" in names and not (d / "gpt2_ckpt" / "latest").exists():
        out = subprocess.run([sys.executable, "-m", "gradsched.train", "--model", "gpt2-tiny", "--steps", "1",
                              "--warmup", "1", "--batch", "2", "--seq", "16", "--compiler", "eager", "--ckpt",
                              str(d / "gpt2_ckpt")], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
        if out.returncode:
            raise RuntimeError(f"saving the gpt2-tiny checkpoint failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(args: list[str], nproc: int = 4, timeout_s: float = 300.0,
             command: tuple[str, ...] = ("-m", "gradsched.train")) -> tuple[list[int], list[str], float]:
    """(exit code of each rank, output of each rank: stdout and stderr together, seconds) of one run of
    gradsched.train (or `python *command`) on `nproc` processes, started with torchrun's variables. A rank
    still running after timeout_s is killed (its exit code then negative)."""
    env = {**os.environ, "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    with tempfile.TemporaryDirectory() as logs:
        files = [open(os.path.join(logs, f"rank{r}.log"), "w+") for r in range(nproc)]
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, *command, *args], cwd=ROOT, stdout=f,
                                  stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  start_new_session=True)
                 for r, f in enumerate(files)]
        try:
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, timeout_s - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        seconds = time.monotonic() - t0
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    return [p.returncode for p in procs], outputs, seconds


def one_line(outputs: list[str]) -> str | None:
    """The run's one line: all ranks' output is exactly one line, rank 0's `gradsched.train: error: ...`."""
    lines = [(r, line) for r, out in enumerate(outputs) for line in out.splitlines() if line.strip()]
    if len(lines) == 1 and lines[0][0] == 0 and lines[0][1].startswith("gradsched.train: error: "):
        return lines[0][1]
    return None


def has_trace(outputs: list[str]) -> bool:
    return any("Traceback (most recent call last)" in out or "frame #" in out for out in outputs)


def measure(name: str, d: Path, repeats: int, nproc: int = 4, timeout_s: float = 300.0) -> dict:
    args = BASE + [a.format(d=d) for a in MISTAKES[name][1]]
    lines, codes, traces, seconds, others = [], collections.Counter(), 0, [], []
    for _ in range(repeats):
        exits, outputs, s = run_once(args, nproc, timeout_s)
        line = one_line(outputs)
        lines.append(line)
        codes.update(str(c) for c in exits)
        traces += has_trace(outputs)
        seconds.append(s)
        if line is None or set(exits) != {2}:
            shown = "; ".join(f"rank {r} (exit {exits[r]}): " + " | ".join(out.strip().splitlines()[:3])[:300]
                              for r, out in enumerate(outputs) if out.strip() or exits[r] != 2)
            if shown not in others:
                others.append(shown)
    common = collections.Counter(x for x in lines if x is not None).most_common(1)
    line = common[0][0] if common else None
    return {"bench": "mistakes", "mistake": name, "what": MISTAKES[name][0], "runs": repeats,
            "same_line_runs": sum(x == line and x is not None for x in lines), "exit_codes": dict(codes),
            "line": line, "tracebacks": traces, "other_outputs": others[:3],
            "seconds": round(statistics.median(seconds), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="runs of each mistake")
    ap.add_argument("--only", nargs="+", choices=list(MISTAKES), help="these mistakes (default: every one)")
    ap.add_argument("--nproc", type=int, default=4, help="processes per run")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before its ranks are killed")
    ap.add_argument("--out", default=None, help="JSON lines file ('' for none; default: benchmarks/results/"
                                                "mistakes.jsonl, or none with --only)")
    args = ap.parse_args(argv)
    from common import RESULTS, emit  # benchmarks/common.py (the script's folder is on sys.path)
    names = args.only or list(MISTAKES)
    out = args.out if args.out is not None else ("" if args.only else RESULTS / "mistakes.jsonl")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(tmp), names)
        for name in names:
            rows.append(measure(name, Path(tmp), args.repeats, args.nproc, args.timeout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: the file is written at the end
    emit(rows, out)
    return 0 if all(r["same_line_runs"] == r["runs"] and set(r["exit_codes"]) == {"2"} for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
