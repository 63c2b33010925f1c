"""The fit's measurements: probes (small dry runs) at a few points, fitted per class into each stage end's
activation terms (gradsched.sizing.fit.End), then every candidate priced (`search`). How the terms are used and
why: gradsched.sizing.fit's docstring."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import time

from gradsched.sizing.fit import Candidate, End, Fitted, ModelShape, Priced, fit_points, in_flight, price


def probe_keys(cands: list[Candidate]) -> list[tuple[bool, bool, object]]:
    """The probes the candidates need: (cp > 1, checkpointing, shard)."""
    return sorted({(c.cp > 1, c.checkpointing, c.shard) for c in cands}, key=repr)


POINTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (layers a stage, sequences) of the probes


def search(shape: ModelShape, cands: list[Candidate], measure, seq: int, global_batch: int, memory: int,
           runtime: int, flops: float, bandwidth: float, progress=print, jobs: int = 1,
           tp_bandwidth: float | None = None) -> list[Priced]:
    """Every candidate priced (see the module docstring), those that fit first, cheapest first.
    measure(layers, sequences, cp, checkpointing, shard, microbatches=1, schedule="auto") -> ((saved, rest,
    accumulating, final, stash) of the first stage, of the last) of a two-stage dry run with `layers` a stage and
    micro-batches of `sequences` (see End; gradsched.dryrun.probe), at `tp=` the candidates' (each tp's
    candidates fitted from probes at that tp alone). jobs > 1: the probes run on that many
    processes at once (`measure_all`; then `measure` must pickle).

    Probes per cp class (cp == 1, cp > 1): shard="params" at the four POINTS, with and without checkpointing
    (all four terms); shard=True at one sequence and 1 and 2 layers, without checkpointing: the shard mode
    changes what a step holds for the parameters and gradients (the terms without a sequence), not the
    activations, so its sequence terms are params' and checkpointing moves its other terms as it moves
    params'. With m > 1 among the candidates, three micro-batches (End's backward peaks): shard="params" at the
    four POINTS, shard=True at 1 and 2 layers (its sequence terms params'), without checkpointing (checkpointing
    shifts them as it shifts rest). With zb1p candidates, the same six under zb1p with three micro-batches (End's
    zero_bubble), per checkpointing. About sixteen to twenty-eight dry runs of a few layers per class instead of one of the whole
    model per candidate."""
    # which probes is a matter of the candidates alone (the arithmetic never branches on a measured value):
    # listed by a first pass that measures nothing, measured (at once where jobs > 1), then fitted
    by_tp = {tp: [c for c in cands if c.tp == tp] for tp in sorted({c.tp for c in cands})}
    wanted: list[tuple] = []
    for tp, group in by_tp.items():
        fitted(group, lambda *a, tp=tp, **k: wanted.append(_key(a, k, tp)) or [(0,) * 5] * 2)
    got = measure_all(measure, list(dict.fromkeys(wanted)), jobs, progress)
    fits = {tp: fitted(group, lambda *a, tp=tp, **k: got[_key(a, k, tp)]) for tp, group in by_tp.items()}
    priced = [price(c, shape, fits[c.tp], seq, global_batch, memory, runtime, flops, bandwidth, tp_bandwidth)
              for c in cands]
    return sorted(priced, key=lambda p: (not p.fits, p.step_s))


def _key(args: tuple, kwargs: dict, tp: int = 1) -> tuple:
    """A probe: (layers, sequences, cp, checkpointing, shard, microbatches, schedule, tp)."""
    return (*args, kwargs.get("microbatches", 1), kwargs.get("schedule", "auto"), tp)


def measure_all(measure, keys: list[tuple], jobs: int, progress=print) -> dict:
    """Each probe's measurement (key -> measure's result), one process each of `jobs` at a time (a probe is one
    process's dry run on torch's fake process group: nothing is shared between them), or in this process at
    jobs=1. A progress line a probe."""
    t0, out = time.perf_counter(), {}

    def done(key, result):
        out[key] = result
        layers, seqs, cp, ckpt, shard, m, schedule, tp = key
        progress(f"fit: probe {len(out)} of {len(keys)} measured ({layers} layer(s) a stage, {seqs} sequence(s), "
                 f"cp {cp}{f', tp {tp}' if tp > 1 else ''}, shard={shard!r}{', checkpointing' if ckpt else ''}"
                 f"{f', {m} micro-batches' if m > 1 else ''}{f', {schedule}' if schedule != 'auto' else ''}; "
                 f"{time.perf_counter() - t0:.0f} s so far)")
    if jobs <= 1 or len(keys) <= 1:
        for key in keys:
            done(key, measure(*key[:5], microbatches=key[5], schedule=key[6], tp=key[7]))
        return out
    # spawn: a fresh interpreter a worker (a fork of this one would inherit its threads' locks)
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(keys)), mp_context=multiprocessing.get_context("spawn"),
                                                initializer=torch_threads, initargs=(1,)) as pool:
        # the largest first (layers x sequences x micro-batches): no long probe left to run alone at the end
        largest = sorted(keys, key=lambda k: -k[0] * k[1] * k[5])
        futures = {pool.submit(measure, *key[:5], microbatches=key[5], schedule=key[6], tp=key[7]): key
                   for key in largest}
        for f in concurrent.futures.as_completed(futures):
            done(futures[f], f.result())
    return out


def torch_threads(n: int) -> None:
    """A probe worker's start: `n` intra-op threads (the workers share the machine's cores)."""
    import torch
    torch.set_num_threads(n)


def fitted(cands: list[Candidate], measure) -> dict:
    """(cp > 1, checkpointing, shard) -> (End of the first stage, of the last), from `measure`'s probes."""
    keys = probe_keys(cands)
    base = {}  # (cp > 1, checkpointing) -> (first, last), shard="params"
    for cpc, ckpt in sorted({k[:2] for k in keys} | {(k[0], False) for k in keys}):
        got = [measure(layers, seqs, 2 if cpc else 1, ckpt, "params") for layers, seqs in POINTS]
        base[(cpc, ckpt)] = tuple(End(*(fit_points(*(g[end][part] for g in got)) for part in (0, 1)))
                                  for end in (0, 1))
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
    return fits


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
