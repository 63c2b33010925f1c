"""python -m gradsched.dryrun --fit: the search's command line (its probes are the dry run's, gradsched.dryrun.probe);
the pricing itself is gradsched.sizing.fit."""
from __future__ import annotations

import json
import time

import torch

from gradsched.sizing import fit, fit_probes
from gradsched.sizing.dryrun_text import parse_bytes, size
from gradsched.training.live_bytes import RUNTIME


def fit_main(args, probe, build) -> int:
    """`probe`: gradsched.dryrun.probe, the dry run that measures; `build(layers, checkpointing)`: the model on
    meta cut to that many layers, and its layers (gradsched.hf). Both handed in: sizing/ imports neither."""
    if args.module or not args.gpus:
        raise SystemExit("--fit: give --gpus, and a model by --model or --config (its layers are cut to measure "
                         "a few; a --module cannot be)")
    if args.schedule == "gpipe":
        raise SystemExit("--fit with --schedule gpipe: the fit searches 1f1b (GPipe where micro-batches are fewer "
                         "than stages) and zb1p; GPipe holds more than 1F1B at the same bubble. Leave --schedule out, "
                         "or give 1f1b or zb1p.")
    dtype, t0 = getattr(torch, args.dtype), time.perf_counter()
    model, layers = build(None, False)
    shape, batch = fit.model_shape(model, dtype.itemsize), args.global_batch or args.gpus
    backend = "nccl" if args.device == "cuda" else "gloo"
    measure = probe(build, args.seq, args.device, backend, bucket_mb=args.bucket_mb)
    cands = fit.candidates(args.gpus, layers, args.seq, batch, checkpointing=(False, True),
                           schedules=fit.SCHEDULES if args.schedule == "auto" else (args.schedule,),
                           tps=fit.tp_sizes(shape, args.max_tp))
    print(f"fit: {len(cands)} layouts of {args.gpus} ranks, {batch} sequences of {args.seq} tokens a step", flush=True)
    priced = fit_probes.search(shape, cands, measure, args.seq, batch, parse_bytes(args.fit), RUNTIME[backend], args.flops,
                               args.bandwidth, progress=lambda s: print(s, flush=True), jobs=args.jobs,
                               tp_bandwidth=args.tp_bandwidth)
    ok = [p for p in priced if p.fits]
    print(f"fit: {len(ok)} of {len(priced)} fit {args.fit} by the estimate ({time.perf_counter() - t0:.0f} s); ranked by "
          "estimated step time = compute / (1 - bubble) + bytes / bandwidth (TP's over the node's). An estimate from probes of 1 and 2 layers "
          "(gradsched.sizing.fit): confirm the plan you pick with a full dry run, e.g.")
    if ok:
        c = ok[0].candidate
        print(f"  python -m gradsched.dryrun {'--config ' + args.config if args.config else '--model ' + args.model} "
              f"--pp {c.pp} --dp {c.dp} --cp {c.cp}{f' --tp {c.tp}' if c.tp > 1 else ''} --shard {str(c.shard).lower()} --microbatches {c.microbatches} "
              f"--batch {batch // c.dp} --seq {args.seq}{' --checkpointing' if c.checkpointing else ''}"
              f"{' --schedule ' + c.schedule if c.pp > 1 else ''}")
    for p in ok[:args.top]:
        c = p.candidate
        print(f"  pp={c.pp} dp={c.dp} cp={c.cp}{f' tp={c.tp}' if c.tp > 1 else ''} shard={c.shard!r} microbatches={c.microbatches} "
              f"{'schedule=' + c.schedule + ' ' if c.pp > 1 else ''}checkpointing="
              f"{c.checkpointing}: peak {size(p.peak)} (stage {p.stage}), {size(p.bytes_per_step)} sent a step, "
              f"bubble {p.bubble:.2f}, ~{p.step_s:.3g} s a step")
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps({"bench": "dryrun_fit", **p.row()}) + "\n" for p in priced)
    return 0 if ok else 1
