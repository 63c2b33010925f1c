"""What gradsched.train reads and shows: token data, the learning-rate schedule, progress, metrics.

A mistake in the user's files is a Mistake: gradsched.train ends with its one line and exit code 2.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch


class Mistake(ValueError):
    """A mistake in the command line or its files that the user can fix: one line, exit code 2."""



class TokenFile:
    """A flat binary file of token ids, read as consecutive windows of seq + 1 tokens. Refused unless
    it holds one global batch of windows, each token inside the vocabulary."""

    def __init__(self, path: str, ids: str, seq: int, vocab: int, batch: int):
        self.tokens = _token_ids(path, ids)
        self.seq, self.windows = seq, (len(self.tokens) - 1) // seq
        if self.windows < batch:  # a step would read the same window twice
            raise Mistake(f"--data {path}: {len(self.tokens)} tokens make {self.windows} windows of --seq {seq} + 1, "
                          f"fewer than one global batch of --batch {batch}: give more data, or a smaller --batch "
                          "or --seq.")
        top = int(self.tokens.max())
        if top >= vocab:
            raise Mistake(f"--data {path} holds token id {top}, but the model's vocabulary has {vocab}: check "
                          "--ids (uint16 or uint32) and the model.")

    def batch(self, step: int, size: int):
        """Windows step*size .. step*size + size - 1 (wrapping around the file): (inputs, next tokens)."""
        rows = []
        for i in range(step * size, (step + 1) * size):
            at = (i % self.windows) * self.seq
            rows.append(torch.from_numpy(self.tokens[at:at + self.seq + 1].astype("int64")))
        w = torch.stack(rows)
        return w[:, :-1], w[:, 1:]


def _token_ids(path: str, ids: str):
    """The file's token ids, mapped (not read); a missing, empty or ragged file is a Mistake."""
    import numpy as np
    dtype = {"uint16": np.uint16, "uint32": np.uint32}[ids]
    if not os.path.isfile(path):
        raise Mistake(f"--data {path}: no such file.")
    size = os.path.getsize(path)
    if size == 0 or size % np.dtype(dtype).itemsize:
        raise Mistake(f"--data {path}: {size} bytes, not a whole, non-zero number of {ids} token ids: check the "
                      "file and --ids.")
    return np.memmap(path, dtype=dtype, mode="r")


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
    """A line per step: rewritten in place on a terminal, else one every `every` steps (and the last)."""

    def __init__(self, total: int, every: int, out=sys.stdout):
        self.total, self.every, self.out, self.tty = total, every, out, out.isatty()

    def show(self, row: dict) -> None:
        done = row["step"]
        bar = "#" * int(20 * done / self.total)
        line = (f"step {done}/{self.total} [{bar:<20}] loss {row['loss']:.4f} lr {row['lr']:.2e} "
                f"{row['tokens_per_s']:,.0f} tok/s {row['step_s'] * 1000:.0f} ms/step"
                + (f" ({row['skipped_steps']} skipped: non-finite)" if row.get("skipped_steps") else ""))
        if self.tty:
            self.out.write("\r" + line + ("\n" if done == self.total else ""))
        elif done % self.every == 0 or done == self.total:
            self.out.write(line + "\n")
        self.out.flush()


def open_metrics(path: str, start: int):
    """The metrics file to append rows to. A run from step 0 starts it anew; a resumed run keeps the
    rows of the steps before its start (the run it resumes) and drops the later ones, which it redoes."""
    kept = []
    if start > 0 and os.path.isfile(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= start]
    f = open(path, "w")
    f.writelines(kept)
    f.flush()
    return f
