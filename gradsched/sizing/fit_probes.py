"""The fit's measurements: probes (small dry runs) at a few points, fitted per class into each stage end's
activation terms (gradsched.sizing.fit.End), then every candidate priced (`search`). How the terms are used and
why: gradsched.sizing.fit's docstring."""
from __future__ import annotations

import dataclasses
import time

from gradsched.sizing.fit import Candidate, End, Fitted, ModelShape, Priced, fit_points, in_flight, price


def probe_keys(cands: list[Candidate]) -> list[tuple[bool, bool, object]]:
    """The probes the candidates need: (cp > 1, checkpointing, shard)."""
    return sorted({(c.cp > 1, c.checkpointing, c.shard) for c in cands}, key=repr)


POINTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (layers a stage, sequences) of the probes


def search(shape: ModelShape, cands: list[Candidate], measure, seq: int, global_batch: int, memory: int,
           runtime: int, flops: float, bandwidth: float, progress=print) -> list[Priced]:
    """Every candidate priced (see the module docstring), those that fit first, cheapest first.
    measure(layers, sequences, cp, checkpointing, shard, microbatches=1, schedule="auto") -> ((saved, rest,
    accumulating, final, stash) of the first stage, of the last) of a two-stage dry run with `layers` a stage and
    micro-batches of `sequences` (see End; gradsched.dryrun.probe).

    Probes per cp class (cp == 1, cp > 1): shard="params" at the four POINTS, with and without checkpointing
    (all four terms); shard=True at one sequence and 1 and 2 layers, without checkpointing: the shard mode
    changes what a step holds for the parameters and gradients (the terms without a sequence), not the
    activations, so its sequence terms are params' and checkpointing moves its other terms as it moves
    params'. With m > 1 among the candidates, three micro-batches (End's backward peaks): shard="params" at the
    four POINTS, shard=True at 1 and 2 layers (its sequence terms params'), without checkpointing (checkpointing
    shifts them as it shifts rest). With zb1p candidates, the same six under zb1p with three micro-batches (End's
    zero_bubble), per checkpointing. About sixteen to twenty-eight dry runs of a few layers per class instead of one of the whole
    model per candidate."""
    done, t0 = [0], time.perf_counter()
    measure_one = measure

    def measure(*args, **kwargs):  # noqa: F811 - counted, for the progress lines
        done[0] += 1
        return measure_one(*args, **kwargs)
    say = lambda text: progress(f"{text} ({done[0]} probes so far, {time.perf_counter() - t0:.0f} s)")  # noqa: E731
    keys = probe_keys(cands)
    base = {}  # (cp > 1, checkpointing) -> (first, last), shard="params"
    for cpc, ckpt in sorted({k[:2] for k in keys} | {(k[0], False) for k in keys}):
        got = [measure(layers, seqs, 2 if cpc else 1, ckpt, "params") for layers, seqs in POINTS]
        base[(cpc, ckpt)] = tuple(End(*(fit_points(*(g[end][part] for g in got)) for part in (0, 1)))
                                  for end in (0, 1))
        say(f"fit: measured cp{'>1' if cpc else '=1'}, checkpointing={ckpt}")
    fits = {}
    for cpc, ckpt, shard in keys:
        if shard == "params":
            fits[(cpc, ckpt, shard)] = base[(cpc, ckpt)]
            continue
        if (cpc, False, shard) not in fits:
            t1, t2 = (measure(layers, 1, 2 if cpc else 1, False, shard) for layers in (1, 2))
            fits[(cpc, False, shard)] = tuple(
                End(*(with_own_parameters(getattr(base[(cpc, False)][e], f), t1[e][i], t2[e][i])
                      for i, f in enumerate(("saved", "rest")))) for e in (0, 1))
            say(f"fit: measured cp{'>1' if cpc else '=1'}, shard={shard!r}")
        if ckpt:
            fits[(cpc, ckpt, shard)] = tuple(
                End(*(moved_like(getattr(fits[(cpc, False, shard)][e], f), getattr(base[(cpc, False)][e], f),
                                 getattr(base[(cpc, True)][e], f)) for f in ("saved", "rest"))) for e in (0, 1))
    backward = {}  # (cp > 1, shard) -> per end (accumulating, final), from three micro-batches: m > 1 only
    for cpc, shard in sorted({(c.cp > 1, c.shard) for c in cands if c.microbatches > 1 and c.schedule != "zb1p"},
                             key=repr):
        if (cpc, "params") not in backward:
            got = [measure(layers, seqs, 2 if cpc else 1, False, "params", microbatches=3) for layers, seqs in POINTS]
            backward[(cpc, "params")] = [[fit_points(*(g[e][part] for g in got)) for part in (2, 3)] for e in (0, 1)]
        if shard != "params":
            t1, t2 = (measure(layers, 1, 2 if cpc else 1, False, shard, microbatches=3) for layers in (1, 2))
            backward[(cpc, shard)] = [[with_own_parameters(f, t1[e][part], t2[e][part]) for f, part in
                                       zip(backward[(cpc, "params")][e], (2, 3))] for e in (0, 1)]
        for key in [k for k in fits if (k[0], k[2]) == (cpc, shard)]:
            plain = fits.get((cpc, False, shard)) or base[(cpc, False)]
            fits[key] = tuple(End(f.saved, f.rest, *(shifted(b, plain[e].rest, f.rest)
                                                     for b in backward[(cpc, shard)][e]))
                              for e, f in enumerate(fits[key]))
        say(f"fit: measured cp{'>1' if cpc else '=1'}, shard={shard!r}, three micro-batches")
    zero_bubble = {}  # (cp > 1, checkpointing, shard) -> per end, (what a B keeps for its W, the peak above)
    for cpc, ckpt, shard in sorted({(c.cp > 1, c.checkpointing, c.shard) for c in cands if c.schedule == "zb1p"},
                                   key=repr):
        def terms(got):
            """Per end: (stash, the probe's peak above its most in flight: f saved and w stashes). Three
            micro-batches: a W between the first and the last holds the gradients summed so far and its new ones
            (two missed that: llama-70b's stages, 13-40% low)."""
            return [([g[e][4] for g in got],
                     [g[e][0] + g[e][1] - max(f * g[e][0] + w * g[e][4] for f, w in in_flight(e, 2, 3, "zb1p"))
                      for g in got]) for e in (0, 1)]
        zb = lambda layers, seqs, shard: measure(layers, seqs, 2 if cpc else 1, ckpt, shard,  # noqa: E731
                                                 microbatches=3, schedule="zb1p")
        if (cpc, ckpt, "params") not in zero_bubble:
            got = [zb(layers, seqs, "params") for layers, seqs in POINTS]
            zero_bubble[(cpc, ckpt, "params")] = [tuple(fit_points(*t) for t in end) for end in terms(got)]
        if shard != "params":
            got = [zb(layers, 1, shard) for layers in (1, 2)]
            zero_bubble[(cpc, ckpt, shard)] = [tuple(with_own_parameters(f, *t) for f, t in zip(params, end))
                                               for params, end in zip(zero_bubble[(cpc, ckpt, "params")],
                                                                      terms(got))]
        fits[(cpc, ckpt, shard)] = tuple(dataclasses.replace(f, stash=zero_bubble[(cpc, ckpt, shard)][e][0],
                                                             zero_bubble=zero_bubble[(cpc, ckpt, shard)][e][1])
                                         for e, f in enumerate(fits[(cpc, ckpt, shard)]))
        say(f"fit: measured cp{'>1' if cpc else '=1'}, checkpointing={ckpt}, shard={shard!r}, zb1p")
    priced = [price(c, shape, fits, seq, global_batch, memory, runtime, flops, bandwidth) for c in cands]
    return sorted(priced, key=lambda p: (not p.fits, p.step_s))


def with_own_parameters(base: Fitted, t11: float, t21: float) -> Fitted:
    """`base`'s sequence terms, with the other two from transients at one sequence and 1 and 2 layers."""
    per_layer = t21 - t11 - base.per_layer_seq
    return Fitted(t11 - per_layer - base.per_seq - base.per_layer_seq, per_layer, base.per_seq, base.per_layer_seq)


def shifted(fitted: Fitted, before: Fitted, after: Fitted) -> Fitted:
    """`fitted` moved by as much as `before` moved into `after`, every term (checkpointing a backward's peak)."""
    return Fitted(*[getattr(fitted, f) + getattr(after, f) - getattr(before, f)
                    for f in ("fixed", "per_layer", "per_seq", "per_layer_seq")])


def moved_like(fitted: Fitted, before: Fitted, after: Fitted) -> Fitted:
    """`fitted` changed as `before` changed into `after` (checkpointing): the latter's sequence terms, and its
    other terms moved by as much."""
    return Fitted(fitted.fixed + after.fixed - before.fixed, fitted.per_layer + after.per_layer - before.per_layer,
                  after.per_seq, after.per_layer_seq)
