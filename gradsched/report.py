"""The schedule report: per rank, the collectives in issue order, with group, bytes and parameters."""
from __future__ import annotations

import torch.fx as fx

from gradsched.passes.graph_utils import META_KEY, collective_group, collective_kind, is_collective


def collectives(gm: fx.GraphModule) -> list[dict]:
    rows = []
    for n in gm.graph.nodes:
        if is_collective(n):
            v = n.args[0].meta["val"]
            tag = n.meta.get(META_KEY) or {}
            rows.append({"node": n.name, "op": collective_kind(n), "group": collective_group(n),
                         "dtype": str(v.dtype).replace("torch.", ""), "bytes": v.numel() * v.element_size(),
                         "role": tag.get("role", "?"), "bucket": tag.get("bucket"),
                         "params": tag.get("params", []), "elements": tag.get("elements")})
    return rows


def tied_bytes(gm: fx.GraphModule) -> int:
    return sum(r["bytes"] for r in collectives(gm) if r["role"].startswith("tie"))


def schedule_report(sync) -> str:
    st = sync._require_state()
    plan, opts = sync.plan, sync.options
    pg, ranks, _ = sync.grad_group()
    names = {pg.group_name: f"grad{list(ranks)}"}
    for t in sync.ties.values():
        tranks, tpg = sync.tie_group_of(t)
        names[tpg.group_name] = f"tie{list(tranks)}"
    out = [f"== {plan.describe()} stage {sync.stage}: mode={opts.mode} shard={opts.shard} "
           f"placement={sync.placement} microbatches={opts.microbatches} sync plan {sync.sync_plan.fingerprint()}"]
    for b in st.layout.buckets:
        slots = ", ".join(f"{s.name}@{s.offset}+{s.numel}" + (" (tied)" if s.tie else "") for s in b.slots)
        out.append(f"   bucket {b.index}: {b.numel} x {str(b.dtype).replace('torch.', '')} [{slots}]")
    graphs = sync.sync_graphs()
    if not graphs:
        return "\n".join(out + ["   (sync graph not built yet)"])
    for sg in graphs:
        buckets = ", ".join(str(b.index) for b in sg.layout.buckets)
        out.append(f"   {'last micro-batch backward graph' if sg.where == 'backward' else 'flush graph'} "
                   f"(buckets {buckets}):")
        for i, r in enumerate(collectives(sg.gm)):
            what = ", ".join(r["params"]) if len(r["params"]) <= 4 else f"{len(r['params'])} params"
            if r["elements"] and r["role"] == "tie_all_reduce_shard":
                what += f" elements {tuple(r['elements'])}"
            out.append(f"   #{i} {r['op']:<14} {names.get(r['group'], r['group']):<16} {r['dtype']:<8} "
                       f"{r['bytes']:>9} B  {r['role']:<20} bucket {r['bucket']}: {what}")
    if opts.shard:
        for b, dtype in zip(st.layout.buckets, sync.sync_plan.gather_dtypes):
            dtype = str(dtype).replace("torch.", "")
            out.append(f"   after step: all_gather   {names[pg.group_name]:<16} {dtype:<8} bucket {b.index} params "
                       f"({b.numel} elements)")
    for sg in graphs:
        if sg.verdict is not None:
            out.append(f"   verifier ({sg.where} graph): " + ("ok" if sg.verdict.ok else "HAZARD"))
            out += [f"     {line}" for line in sg.verdict.proofs + sg.verdict.hazards]
    return "\n".join(out)
