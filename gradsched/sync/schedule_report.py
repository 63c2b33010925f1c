"""The schedule report: per rank, the collectives in issue order, with group, bytes and parameters."""
from __future__ import annotations

import torch.fx as fx

from gradsched.passes.context_parallel import effective_window
from gradsched.passes.graph_utils import META_KEY, collective_group, collective_kind, is_collective

from gradsched.sync import pass_pipeline


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


def schedule_report(setup, plan, graphs, verdicts: dict, opts, local_ties=()) -> str:
    """setup: the stage's StageSetup; plan: its SyncPlan; graphs: its built SyncGraphs in run order;
    verdicts: graph -> the verifier's verdict, for the graphs checked so far; local_ties: under several stages a
    rank, the names of each tie whose copies all sit on this rank (one Parameter, the kept name first)."""
    names = {plan.grad_group.name: f"grad{list(plan.grad_group.ranks)}"}
    names.update({g.name: f"tie{list(g.ranks)}" for g in plan.tie_groups.values()})
    out = [f"== {setup.where} stage {setup.stage}: mode={opts.mode} shard={opts.shard} "
           f"placement={plan.placement} microbatches={opts.microbatches} sync plan {plan.fingerprint()}"]
    for b in plan.layout.buckets:
        slots = ", ".join(f"{s.name}@{s.offset}+{s.numel}" + (" (tied)" if s.tie else "") for s in b.slots)
        out.append(f"   bucket {b.index}: {b.numel} x {str(b.dtype).replace('torch.', '')} [{slots}]")
    for names_ in local_ties:
        out.append(f"   tie on this rank: {' = '.join(names_)}: one Parameter for every stage here, its gradients "
                   "summed by autograd into one .grad; no collective, 0 bytes")
    if not graphs:
        return "\n".join(out + ["   (sync graph not built yet)"])
    for sg in graphs:
        buckets = ", ".join(str(b.index) for b in sg.layout.buckets)
        out.append(f"   {_graph_name(sg.where)} (buckets {buckets}):")
        conditions = pass_pipeline.Conditions(shard=plan.shard, where=sg.where, zero_bubble=sg.halves is not None,
                                              check_ranks=opts.check_ranks)
        out.append("     passes: " + " -> ".join(pass_pipeline.applicable(("sync", "cut", "checked", "compiled"),
                                                                         conditions)))
        for i, r in enumerate(collectives(sg.gm)):
            what = ", ".join(r["params"]) if len(r["params"]) <= 4 else f"{len(r['params'])} params"
            if r["elements"] and r["role"] == "tie_all_reduce_shard":
                what += f" elements {tuple(r['elements'])}"
            out.append(f"   #{i} {r['op']:<14} {names.get(r['group'], r['group']):<16} {r['dtype']:<8} "
                       f"{r['bytes']:>9} B  {r['role']:<20} bucket {r['bucket']}: {what}")
    if plan.shard:
        grad = names[plan.grad_group.name]
        when = "in each graph, before use" if plan.params_sharded else "after step:"
        for b, dtype in zip(plan.layout.buckets, plan.gather_dtypes):
            dtype = str(dtype).replace("torch.", "")
            out.append(f"   {when} all_gather   {grad:<16} {dtype:<8} bucket {b.index} params "
                       f"({b.numel} elements)")
    for sg in graphs:
        verdict = verdicts.get(sg.where)
        if verdict is not None:
            out.append(f"   verifier ({sg.where} graph): " + ("ok" if verdict.ok else "HAZARD"))
            out += [f"     {line}" for line in verdict.proofs + verdict.hazards]
    return "\n".join(out)


def _graph_name(where: str) -> str:
    if where.startswith("early"):
        return (f"early graph {where[5:]} (issued as the rank's stage graph number {int(where[5:]) + 1} to finish "
                "runs its last W, waited for at the flush)")
    return "last micro-batch backward graph" if where == "backward" else "flush graph"


def ring_steps(cp: int, local_len: int, causal: bool, load_balance: bool, window, comm: str,
               a2a_degree: int | None = None, q_heads: int = 1, kv_heads: int = 1) -> list[int]:
    """The ring steps an attention call runs: all cp of them, fewer with a window shorter than the
    sequence (gradsched.cp.ring_masked skips the steps nobody needs); [] for a2a. Under hybrid the ring
    runs over cp / a2a_degree ranks on the joint slices of an all-to-all group. Under
    load_balance="documents" every document is spread over the sequence: a window skips nothing."""
    from gradsched.cp.comm import resolve_comm
    from gradsched.cp.ring_masked import MaskedRing
    if comm == "auto" or (comm == "hybrid" and a2a_degree is None):
        choice = resolve_comm(comm, a2a_degree, call="report", q_heads=q_heads, kv_heads=kv_heads, cp=cp,
                              masked=effective_window(window, local_len * cp) is not None, causal=causal)
        comm, a2a_degree = choice.comm, choice.a2a
    if comm == "a2a":
        return []
    a = a2a_degree if comm == "hybrid" else 1
    ring_cp, joint = cp // a, local_len * a
    window = effective_window(window, joint * ring_cp)
    parts = 2 if load_balance and ring_cp > 1 else 1
    return MaskedRing(0, ring_cp, causal, bool(load_balance), 1.0, "fp32", joint // parts, window,
                      window_on_positions=load_balance == "documents").steps()


def attention_report(reports) -> str:
    """Context parallelism: per lowered attention call, the scheme (comm='auto' says what it picked and why)
    and the ring steps it runs (a window shorter than the sequence skips steps). '' when nothing was lowered."""
    out = []
    for rep in reports:
        if not rep.lowered:
            continue
        out.append(f"   context parallel (cp={rep.cp}): {len(rep.lowered)} attention call(s) lowered")
        for c in rep.lowered:
            line = f"     {c.node}: {c.comm}" + (f" (a2a over {c.a2a_degree} x ring over {rep.cp // c.a2a_degree})"
                                                 if c.comm == "hybrid" else "")
            if c.window is not None:
                line += f", window {c.window}"
            if c.load_balance == "documents":
                line += ", documents balanced over the ranks"
            if c.inside:  # its backward runs the ring again (activation checkpointing recomputes it)
                line += f", inside an {c.inside}" if c.inside[0] in "aeiou" else f", inside a {c.inside}"
            if c.comm in ("ring", "allgather", "hybrid") and c.local_len:
                steps = ring_steps(rep.cp, c.local_len, c.causal, c.load_balance, c.window, c.comm, c.a2a_degree)
                line += f", ring steps {steps} of {rep.cp // (c.a2a_degree if c.comm == 'hybrid' else 1)}"
            out.append(line + (f" -- {c.why}" if c.why else ""))
            out.append(f"       masks: {applied_masks(c)}")
    return "\n" + "\n".join(out) if out else ""


def applied_masks(call) -> str:
    """Every mask a lowered call (passes.context_parallel.LoweredAttention) applies, as the ring applies it:
    causal, its window, documents (explicit seq_idx, else position ids that restart: gradsched.masks.attention
    reads positions as documents only without seq_idx) and padding; 'none' for full attention."""
    given = call.masks
    masks = ["causal"] if call.causal else []
    if call.window is not None:
        masks.append(f"window {call.window}")
    if "seq_idx" in given:
        masks.append("documents (seq_idx)")
    elif "position_ids" in given:
        masks.append("documents (where position ids restart)")
    if "key_padding" in given:
        masks.append("padding (attention_mask)")
    return ", ".join(masks) or "none"
