"""The dry run's accounting of one role: what a rank holds, its collectives by group, the verifier's verdict."""
from __future__ import annotations

from typing import TYPE_CHECKING

from gradsched.training.live_bytes import storage_bytes

if TYPE_CHECKING:
    from gradsched.sizing.roles import Role


def held_bytes(pm, opt) -> int:
    """Bytes of training state the rank holds now (distinct storages)."""
    sync = pm.grad_sync
    if sync is None or sync.built is None:
        return 0
    inner = opt.optimizer
    shards = list(sync.param_shards.shards.values()) if sync.param_shards is not None else []
    state = [v for s in inner.state.values() for v in s.values()] if inner is not None else []
    return storage_bytes([*sync.params.values(), *(p.grad for p in sync.params.values()), *sync.reduced(),
                          *shards, *opt.masters, *state])


def account(role: Role, pm, opt) -> None:
    """Split what the rank holds as its optimizer is about to step."""
    sync = pm.grad_sync
    shards = sync.param_shards
    params = list(shards.shards.values()) if shards is not None else list(sync.params.values())
    role.params = storage_bytes(params)
    role.grads = storage_bytes([*sync.reduced(), *(p.grad for p in sync.params.values())])
    role.masters = storage_bytes([*params, *opt.masters]) - role.params  # fp32 shards are their own masters
    role.optimizer = storage_bytes([v for s in opt.optimizer.state.values() for v in s.values()])
    role.buckets = [b.numel for b in sync.sync_plan.layout.buckets]


def by_group(tally: dict, plan, pm) -> dict:
    import torch.distributed as dist
    kinds = ("grad", "dp", "cp", "pp") + (("tp", "stage") if plan.tp > 1 else ())
    names = {dist.group.WORLD.group_name: "world", **{plan.process_group(k).group_name: k for k in kinds}}
    for key, g in pm.grad_sync.setup.tie_groups.items():
        names[g.name] = f"tie {key}"
    out = {}
    for (op, group), n in sorted(tally.items()):
        label = f"{op} over {names.get(group, 'group ' + group)}"
        out[label] = out.get(label, 0) + n
    return out


def verdict(sync, built) -> str:
    """The verifier over this stage's sync graphs, each tie checked with every holding stage's layout."""
    from gradsched.passes import TieCheck, TieLayout
    from gradsched.sync import pass_pipeline
    layouts = {}
    for other in built:
        plan = other.sync_plan
        for name, tie in other.setup.ties.items():
            bucket, slot = plan.layout.locate(name)
            layouts.setdefault(tie.key, []).append(TieLayout(other.setup.rank, name, bucket.index, slot.offset,
                                                             slot.numel, bucket.numel, plan.layout.shards))
    lines = []
    for sg in sync.sync_graphs():
        names = {s.name for b in sg.layout.buckets for s in b.slots}
        ties = {n: t for n, t in sync.setup.ties.items() if n in names}
        checks = [TieCheck(t.key, sync.sync_plan.tie_groups[t.key].name, sg.record.sources[n], layouts[t.key], {})
                  for n, t in sorted(ties.items(), key=lambda kv: kv[1].key)]
        v = pass_pipeline.run("checked", sg.gm, pass_pipeline.Conditions.of(sync.options),
                              {"verify_graph": (checks, sync.setup.rank)})["verify_graph"]
        if not v.ok:
            lines.append(f"{sg.where} graph: HAZARD: " + " ".join(v.hazards))
        else:
            lines.append(f"{sg.where} graph: ok, " + (f"{len(v.proofs)} tie(s) proven" if checks else "no ties"))
    proof = getattr(sync.built, "tp_proof", None)  # tp > 1: every parameter's TP reduction, from the backward
    if proof is not None:
        never = sum(1 for _, how in proof.proved if how == "never summed")
        lines.append(f"tensor parallel: HAZARD: {'; '.join(proof.hazards)}" if not proof.ok else
                     f"tensor parallel: ok, {len(proof.proved)} parameters proven ({never} TP shards never summed "
                     f"over tp, {len(proof.proved) - never} replicated summed once)")
    return "; ".join(lines)
