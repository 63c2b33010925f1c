"""Train the tiny tied GPT under a plan and against its single-process reference.

Shared by the demo, the tests and the tied_grad_sync benchmark, so the three
measure the same thing. The reference is the same model, unsplit, in one
process, on the whole global batch, with the same optimizer.
"""
from __future__ import annotations

import contextlib

import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from tiny_gpt import GPTConfig, TinyGPT, checkpoint_kwargs, lm_loss, lm_loss_sum, make_batch


@dataclass
class Job:
    pp: int = 2
    dp: int = 2
    cp: int = 1
    steps: int = 3
    global_batch: int = 8
    lr: float = 1e-3  # a small GPT's usual rate; Adam scales rounding noise of near-zero gradients by lr
    seed: int = 0
    config: GPTConfig = field(default_factory=GPTConfig)
    model: str = "tiny_gpt"  # or a name in gradsched.hf.MODELS (Hugging Face)
    dtype: str = "float32"  # the parallel run's parameter dtype; the reference is always fp32
    data_batches: int = 0  # 0: a fresh random batch each step; k: cycle over k fixed batches
    split_points: tuple = ("blocks.1",)
    schedule: str = "auto"
    options: dict = field(default_factory=lambda: {"compiler": "eager"})

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp
    rank_options: dict = field(default_factory=dict)  # rank -> options overriding `options` there
    ties: list | None = None  # explicit tie declaration (override); None: discover
    capture_code: bool = False  # return the code Inductor generates during the first step
    host_reads: tuple = ()  # steps (from 0) whose host reads of device values are recorded (result "reads")
    inject_host_read: bool = False  # then one more step with an .item() added in the loss weighting ("injected")
    optimizer: str = "adamw"  # or "sgd": its update is the gradient itself, so scale errors show
    plain_optimizer: bool = False  # shard=False: torch.optim's own over model.parameters(), built before the first
    # step (as a user writes it), instead of gradsched.DistributedOptimizer
    labels: str = "full"  # "padded": right padding with ignore_index, some sequences (and a micro-batch) empty
    loss: str = "mean"  # "sum": lm_loss_sum, for average=False
    variant: str = ""  # tiny_gpt only: "untied" (no tie at all), "hidden_tie" (blocks.1.proj = blocks.0.proj too)
    clip: float = 0.0  # > 0: clip gradients to this global norm before each step
    param_groups: str = ""  # "decay_matrices": weight decay on >= 2-D parameters only (gradsched.weight_decay_groups)
    inputs: str = ""  # Hugging Face models: "documents" (packed: positions restart), "padding" (attention_mask)
    checkpointing: str = ""  # activation checkpointing, in the parallel run and the reference alike: a mode of
    # tiny_gpt.checkpoint_kwargs (tiny_gpt: torch.utils.checkpoint around each block, as a user writes it;
    # Hugging Face: the model's own gradient_checkpointing_enable)
    hf_stages: int = 0  # Hugging Face models: split the decoder layers evenly into this many stages (0: 2)

    @property
    def loss_fn(self):
        return lm_loss_sum if self.loss == "sum" else lm_loss


# right padding per sequence of a batch of 8: two whole sequences are padding (one micro-batch of
# a dp rank holds nothing but ignore_index), the others differ in length
PAD_TAIL = (0, 5, 3, 16, 16, 16, 9, 1)


def batch(job: Job, step: int):
    k = step % job.data_batches if job.data_batches else step
    x, y = make_batch(job.global_batch, job.config, seed=job.seed + 1 + k)
    if job.inputs == "padding":  # pads score nothing
        y = y.masked_fill(model_inputs(job, step)["attention_mask"] == 0, -100)
    if job.labels == "padded":
        y = pad_labels(y, step)
    return x, y


def pad_labels(y: torch.Tensor, step: int) -> torch.Tensor:
    """`y` right-padded with ignore_index by PAD_TAIL: a labelled count that differs from step to step (gradsched
    weights a step's losses by the last one's)."""
    y = y.clone()
    for i in range(len(y)):
        pad = min(PAD_TAIL[(i * (step + 1)) % len(PAD_TAIL)], y.shape[1])
        y[i, y.shape[1] - pad:] = -100
    return y


# packed documents per sequence (lengths cycle over the batch); right padding per sequence
DOC_LENGTHS = ((5, 18, 1, 26, 14), (64,), (30, 34), (7, 9, 11, 13, 24))
PAD_RIGHT = (0, 13, 40, 3)


def model_inputs(job: Job, step: int) -> dict:
    """positions / attention_mask for train_step and the reference (the global batch), or {}."""
    n, seq = job.global_batch, job.config.seq
    if job.inputs == "documents":
        rows = []
        for i in range(n):
            lengths = DOC_LENGTHS[(i + step) % len(DOC_LENGTHS)]
            pos = torch.cat([torch.arange(k) for k in lengths])
            rows.append(torch.cat([pos, torch.arange(seq - len(pos))])[:seq])
        return {"positions": torch.stack(rows)}
    if job.inputs == "padding":
        mask = torch.ones(n, seq, dtype=torch.long)
        for i in range(n):
            pad = PAD_RIGHT[(i + step) % len(PAD_RIGHT)]
            if pad:
                mask[i, seq - pad:] = 0
        return {"positions": torch.arange(seq).expand(n, seq), "attention_mask": mask}
    if job.inputs:
        raise ValueError(f"unknown inputs {job.inputs!r}")
    return {}


def build_model(job: Job):
    """(model, split points) with the job's seed: the same weights in every process."""
    torch.manual_seed(job.seed)
    if job.model == "tiny_gpt":
        model = TinyGPT(replace(job.config, checkpoint=job.checkpointing))
        if job.variant == "untied":
            model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
        elif job.variant == "hidden_tie":  # a second tie between the same two stages
            model.blocks[1].proj.weight = model.blocks[0].proj.weight
        elif job.variant:
            raise ValueError(f"unknown tiny_gpt variant {job.variant!r}")
        return model, list(job.split_points)
    from gradsched.hf import MODELS
    c = job.config
    model, split_points = MODELS[job.model](vocab=c.vocab, seq=c.seq, dim=c.dim, layers=c.layers, heads=c.heads)
    if job.hf_stages:  # several stages a rank (zbv): the decoder layers in hf_stages even runs
        stack = split_points[0].rsplit(".", 1)[0]
        split_points = [f"{stack}.{i * c.layers // job.hf_stages}" for i in range(1, job.hf_stages)]
    if job.checkpointing:
        kw = checkpoint_kwargs(job.checkpointing)
        if hasattr(model.model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
            model.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return model, split_points


def optimizer_kwargs(job: Job) -> dict:
    return {"lr": job.lr, "weight_decay": 0.1}


def group_options(job: Job):
    """The job's parameter groups as a function (name, parameter) -> options, or None."""
    if not job.param_groups:
        return None
    if job.param_groups != "decay_matrices":
        raise ValueError(f"unknown param_groups {job.param_groups!r}")
    from gradsched.training.param_groups import weight_decay_groups
    return weight_decay_groups(optimizer_kwargs(job)["weight_decay"])


def torch_groups(job: Job, model) -> list:
    """The same groups as torch.optim takes them, for the one-process reference."""
    options = group_options(job)
    if options is None:
        return list(model.parameters())
    return [{"params": [p], **options(n, p)} for n, p in model.named_parameters()]


def optimizer_class(job: Job):
    return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[job.optimizer]


def reference(job: Job) -> dict:
    """Unsplit model, one process: losses per step and every parameter by every name it has."""
    model, _ = build_model(job)
    if job.model.startswith("hf_"):  # HF's own attention, building its own masks: independent of the adapter
        model.model.set_attn_implementation("sdpa")
    opt = optimizer_class(job)(torch_groups(job, model), **optimizer_kwargs(job))
    losses, grads, norms = [], {}, []
    for step in range(job.steps):
        x, y = batch(job, step)
        extra = model_inputs(job, step)
        loss = job.loss_fn(model(x, extra.get("positions"), extra.get("attention_mask")) if extra else model(x), y)
        loss.backward()
        if step in (0, job.steps - 1):  # every name a parameter has, tied names included (one Parameter, one gradient)
            last_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
            grads = grads or last_grads
        if job.clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    from gradsched.sync.ties import shared_parameters
    return {"losses": losses, "params": params, "grads": grads, "last_grads": last_grads, "aliases": shared_parameters(model), "norms": norms,
            "state_keys": list(model.state_dict())}


def rank_main(rank: int, world: int, job: Job) -> dict:
    """One rank of the parallel run; returns what it ends with (see keys)."""
    import gradsched

    plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp, cp=job.cp)
    opts = {**job.options, **job.rank_options.get(rank, {})}
    model, split_points = build_model(job)
    model = gradsched.parallelize(model.to(getattr(torch, job.dtype)), plan=plan, loss_fn=job.loss_fn,
                                  split_points=split_points if job.pp > 1 else (), schedule=job.schedule, ties=job.ties,
                                  **opts)
    if job.plain_optimizer:
        opt = optimizer_class(job)(torch_groups(job, model), **optimizer_kwargs(job))
    else:
        opt = gradsched.DistributedOptimizer(model, optimizer_class(job), param_groups=group_options(job),
                                             **optimizer_kwargs(job))
    dp_idx, cp_idx = plan.index("dp"), plan.index("cp")
    grads = None
    per_rank = job.global_batch // job.dp
    losses, times, code, norms = [], [], [], []
    reads, value_reads = [], []
    for step in range(job.steps):
        x, y = batch(job, step)
        sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
        extra = {k: t[sl] for k, t in model_inputs(job, step).items()}
        t0 = time.perf_counter()
        with recording(step in job.host_reads) as seen:  # the step, not the test's own reads below
            if job.capture_code and step == 0:
                from torch._inductor.utils import run_and_get_code
                loss, code = run_and_get_code(model.train_step, x[sl], y[sl], **extra)
            else:
                loss = model.train_step(x[sl], y[sl], **extra)
            if step in (0, job.steps - 1):
                last_grads = reduced_gradients(model.grad_sync)
                grads = grads or last_grads
            norm = gradsched.clip_grad_norm_(model, job.clip) if job.clip else None
            opt.step()
            opt.zero_grad()
        reads += [r.text() for r in seen.unexpected()] if seen is not None else []
        if seen is not None:  # every read but torch's optimizers' step counters (kept on the CPU)
            value_reads.append([r.where() for r in seen.all if "torch/optim/" not in r.where()])
        if norm is not None:
            norms.append(norm.item())
        times.append(time.perf_counter() - t0)
        losses.append(None if loss is None else float(loss))
    sync = model.grad_sync
    state = model.state_dict()  # every rank calls it: under pp > 1 it gathers the stages
    return {
        "state_dict": state, "named_parameters": [n for n, _ in model.named_parameters()],
        "rank": rank, "stage": plan.stage, "dp_idx": dp_idx, "cp_idx": cp_idx,
        "losses": losses, "step_times": times, "norms": norms,
        "params": {n: v.clone() for n, v in sync.full_parameters().items()},
        "ties": [t.members for t in sync.ties.values()],
        "tied_buckets": [sync.sync_plan.layout.locate(name)[0].index for name in sync.ties],
        "n_buckets": len(sync.sync_plan.layout.buckets),
        "bucket_params": [[s.name for s in b.slots] for b in sync.sync_plan.layout.buckets],
        "bucket_numels": [b.numel for b in sync.sync_plan.layout.buckets],
        "split_points": list(split_points),
        "early_log": list(sync.early.log),
        "report": sync.schedule_report(),
        "verifier": "ok" if all(v.ok for v in sync.verdicts.values()) else "hazard",
        "verdict": "\n".join(map(str, sync.verdicts.values())),
        "tied_bytes_per_step": sync.tied_bytes_per_step(),
        "within_module_ties": model.within_module_ties,
        "sync_runs": sync.sync_runs, "backward_calls": sync.backward_calls, "w_queued_max": sync.w_queued_max, "flush_seconds": sync.flush_seconds,
        # what the user's model itself still holds (under pp > 1: this rank's stage, the rest released)
        "unsplit_numel_held": sum(t.numel() for t in model.unsplit_module().parameters() if not t.is_meta),
        "stage_numel": sum(t.numel() for _, t in model.named_parameters()),
        # a plain optimizer built before the split holds every stage's Parameters: the others' storage is released
        # several stages a rank: the copies its stages hold of a tie and never read (a V's, on rank 0): released
        "unread_tied_bytes": unread_tied_bytes(model),
        "plain_optimizer_bytes": sum({id(p): p.untyped_storage().nbytes() for g in opt.param_groups
                                      for p in g["params"]}.values()) if job.plain_optimizer else None,
        "stage_param_bytes": sum({id(p): p.untyped_storage().nbytes() for _, p in model.named_parameters()}.values()),
        # a tied weight's copy the split leaves on a stage that never reads it (stage 0 keeps the head's): released
        "stale_bytes": sum(t.untyped_storage().nbytes() for n, t in model.model_state.trained_module().named_parameters(
            remove_duplicate=False) if n in model.model_state.stale_names()),
        "code": code, "grads": grads, "last_grads": last_grads, "reads": reads, "value_reads": value_reads,
        "sync_graph_ops": [str(n.target) for sg in sync.sync_graphs() for n in sg.gm.graph.nodes
                           if n.op == "call_function"],
        "sync_graph_buckets": {sg.where: [b.index for b in sg.layout.buckets] for sg in sync.sync_graphs()},
        "sync_code": {sg.where: sg.code for sg in sync.sync_graphs()},
        "grad_group": sync.sync_plan.grad_group.name,
        # shard="params": what the rank holds of its parameters (their own storage is released)
        "param_storage_bytes": sum(p.untyped_storage().nbytes() for p in sync.params.values()),
        "param_shard_bytes": sum(t.numel() * t.element_size() for t in sync.param_shards.shards.values())
        if sync.param_shards is not None else None,
    } | ({"injected": step_with_an_injected_read(model, opt, job, dp_idx)} if job.inject_host_read else {})


def recording(on: bool):
    from gradsched.training import host_reads
    return host_reads.recording() if on else contextlib.nullcontext()


def unread_tied_bytes(model) -> int:
    from gradsched.sync.ties import used_parameters
    names = {n for t in model.ties for _, n in t.members}
    return sum(t.untyped_storage().nbytes() for m in getattr(model.model_state.stage_module, "stage_modules", ())
               for n, t in m.named_parameters(remove_duplicate=False) if n in names and n not in used_parameters(m))


def step_with_an_injected_read(model, opt, job: Job, dp_idx: int) -> list:
    """The host reads of one more step in which gradsched's label count reads its value with .item()
    (tests/test_host_reads.py: the recorder must see it, with its line)."""
    from gradsched.training import loss_weights
    labelled = loss_weights.micro_batch_counts

    def reading(targets, m, ignore_index):
        counts = labelled(targets, m, ignore_index)
        n = counts.sum()
        n.item()  # the injected read
        return counts
    x, y = batch(job, job.steps)
    per_rank = job.global_batch // job.dp
    sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
    loss_weights.micro_batch_counts = reading
    try:
        with recording(True) as seen:
            model.train_step(x[sl], y[sl])
            opt.step()
            opt.zero_grad()
    finally:
        loss_weights.micro_batch_counts = labelled
    return [r.text() for r in seen.unexpected()]


def rank_jobs(rank: int, world: int, jobs: list) -> list:
    """Several jobs in one set of processes (start-up dominates small jobs): each job's result,
    or ("error", text) for a job that failed on this rank.

    After a failure the remaining jobs are not run: the other ranks may not have failed, and
    would wait in the next job's collectives for this one (a hang until the timeout); returning
    ends this process, and theirs fail fast on the closed connection."""
    import traceback
    out = []
    for i, job in enumerate(jobs):
        torch._dynamo.reset()  # a fresh model per job: no cache limit, no guards from the last one
        try:
            out.append(rank_main(rank, world, job))
        except Exception as e:  # noqa: BLE001 - reported to the test, which names the job
            out.append(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            out += [("error", "not run: an earlier job failed on this rank")] * (len(jobs) - i - 1)
            break
    return out


def reduced_gradients(sync) -> dict:
    """What this rank holds after a step's gradient sync (a GradSync): its reduced shard of every bucket
    (shard=True) with the layout to read it, or every parameter's .grad (shard=False)."""
    if not sync.options.shard:
        return {"full": {n: p.grad.detach().clone() for n, p in sync.params.items()}}
    plan = sync.sync_plan
    return {"shards": [r.detach().clone() for r in sync.reduced()], "shard_index": plan.grad_group.index,
            "shards_n": len(plan.grad_group.ranks),
            "buckets": [(b.numel, [(s.name, s.offset, s.numel) for s in b.slots]) for b in plan.layout.buckets]}


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| as a float, and inf if either side holds a NaN or an inf: every comparison here
    reports a non-finite value as a failure (max(0.0, nan) is 0.0, and inf - inf is NaN)."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    d = (a - b).abs()
    return d.max().item() if d.numel() else 0.0


def gradient_error(ref: dict, ranks: list[dict]) -> float:
    """Max |reduced gradient - reference gradient| over every rank, relative to max |reference gradient|.

    The reference is the unsplit model's .grad after one backward over the global batch; each rank's
    shard is compared with the matching slice of the reference's gradients laid out as its bucket.
    inf when a gradient on either side holds a NaN or an inf."""
    if not all(torch.isfinite(g).all() for g in ref["grads"].values()):
        return math.inf  # a NaN would otherwise drop out of the scale below
    scale = max(g.abs().max().item() for g in ref["grads"].values())
    worst = 0.0
    for r in ranks:
        got = r["grads"]
        if "full" in got:
            for name, g in got["full"].items():
                worst = max(worst, abs_diff(g.double(), ref["grads"][name].double()))
            continue
        for shard, (numel, slots) in zip(got["shards"], got["buckets"]):
            flat = torch.zeros(numel, dtype=torch.float64)
            for name, offset, n in slots:
                flat[offset:offset + n] = ref["grads"][name].double().reshape(-1)
            size = numel // got["shards_n"]
            want = flat[got["shard_index"] * size:(got["shard_index"] + 1) * size]
            worst = max(worst, abs_diff(shard.double(), want))
    return worst / scale


def compare(ref: dict, ranks: list[dict]) -> dict:
    """Max |parallel - reference| over every parameter of every rank (inf if either holds a NaN or an
    inf), and tied-copy equality."""
    worst, missing = 0.0, []
    for r in ranks:
        for name, p in r["params"].items():
            if name not in ref["params"]:
                missing.append(name)
                continue
            worst = max(worst, abs_diff(p, ref["params"][name]))
    # tied copies: every stage's copy of one weight, on the same dp index, bitwise equal
    tied_equal = True
    for r in ranks:
        for members in r["ties"]:
            for other in ranks:
                same_slot = (other["dp_idx"], other.get("cp_idx", 0)) == (r["dp_idx"], r.get("cp_idx", 0))
                if same_slot and other["stage"] != r["stage"]:
                    mine = dict(members).get(r["stage"])
                    theirs = dict(members).get(other["stage"])
                    if mine and theirs:
                        tied_equal &= torch.equal(r["params"][mine], other["params"][theirs])
    covered = {n for r in ranks for n in r["params"]}
    aliased = {n for group in ref["aliases"] if covered & set(group) for n in group}
    return {"max_abs_diff": worst, "tied_bitwise_equal": tied_equal, "missing": missing,
            "uncovered": sorted(set(ref["params"]) - covered - aliased)}


def job_dict(job: Job) -> dict:
    d = asdict(job)
    d["config"] = asdict(job.config)
    return d


def resume_main(rank: int, world: int, job: Job, save_to: str, load_from: str | None, stop: int,
                save_every: int = 0) -> dict:
    """Train `job` from the start, or from the checkpoint at `load_from`, up to step `stop`, then save
    to `save_to` (every `save_every` steps too). The data position comes back with the checkpoint."""
    import gradsched

    plan = gradsched.ParallelPlan.from_world(pp=job.pp, dp=job.dp, cp=job.cp)
    model, split_points = build_model(job)
    model = gradsched.parallelize(model.to(getattr(torch, job.dtype)), plan=plan, loss_fn=job.loss_fn,
                                  split_points=split_points if job.pp > 1 else (), schedule=job.schedule,
                                  **job.options)
    opt = gradsched.DistributedOptimizer(model, optimizer_class(job), param_groups=group_options(job),
                                         **optimizer_kwargs(job))
    start = gradsched.load(load_from, model, opt)["data_position"] if load_from else 0
    dp_idx = plan.index("dp")
    per_rank = job.global_batch // job.dp
    sl = slice(dp_idx * per_rank, (dp_idx + 1) * per_rank)
    losses = []
    for step in range(start, stop):
        x, y = batch(job, step)
        loss = model.train_step(x[sl], y[sl])
        if job.clip:
            gradsched.clip_grad_norm_(model, job.clip)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
        if save_every and (step + 1) % save_every == 0 and step + 1 < stop:
            gradsched.save(save_to, model, opt, step=step + 1)
    gradsched.save(save_to, model, opt, step=stop)
    return {"start": start, "losses": losses}


def checkpoint_contents(path: str) -> dict:
    """A checkpoint's tensors, whole, read back in this one process by DCP itself (independent of the
    layout that wrote it)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gradsched.training.checkpoint import checkpoint_dir
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/whole.pt"
        dcp_to_torch_save(checkpoint_dir(path), out)
        return torch.load(out, weights_only=False)


def max_state_diff(a: dict, b: dict, prefixes=("model/", "optim/")) -> float:
    """Max |a - b| over the parameters, master weights and optimizer state of two checkpoints (which
    must hold the same keys); inf where either holds a NaN or an inf."""
    keys = sorted(k for k in a if k.startswith(prefixes))
    assert keys == sorted(k for k in b if k.startswith(prefixes)), set(a) ^ set(b)
    return max(abs_diff(a[k].double(), b[k].double()) for k in keys)
