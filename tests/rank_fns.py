"""Per-rank bodies for the multi-process tests (spawned processes import them by module name)."""
import torch

import gradsched
from gradsched.sync.owners import sync_of
from tied_training import Job, optimizer_class, optimizer_kwargs, reduced_gradients
from tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch


def plan_errors(rank, world):
    out = []
    for kwargs in ({"pp": 3}, {"pp": 1, "dp": 3}, {"pp": 0}):
        try:
            gradsched.ParallelPlan.from_world(**kwargs)
            out.append(None)
        except gradsched.PlanError as e:
            out.append(str(e))
    return out


def compile_with_backend_name(rank, world, job: Job, options: dict, distributed_optimizer: bool):
    """Data parallel through torch.compile(backend="gradsched"), with the README's optimizer for the options."""
    plan = gradsched.ParallelPlan.from_world(pp=1)
    torch.manual_seed(job.seed)
    model = TinyGPT(job.config)
    compiled = torch.compile(model, backend="gradsched", fullgraph=True, options={"plan": plan, **options})
    if distributed_optimizer:  # found from the compiled model's parameters
        opt = gradsched.DistributedOptimizer(compiled, optimizer_class(job), **optimizer_kwargs(job))
    else:
        opt = optimizer_class(job)(model.parameters(), **optimizer_kwargs(job))
    return train_by_backend_name(rank, world, job, model, compiled, opt)


def train_by_backend_name(rank, world, job: Job, model, compiled, opt) -> dict:
    """Data parallel steps of a model compiled with backend="gradsched": this rank's share of each batch;
    the first step's reduced gradients and the final parameters."""
    per, grads = job.global_batch // world, None
    for step in range(job.steps):
        x, y = make_batch(job.global_batch, job.config, seed=job.seed + 1 + step)
        lm_loss(compiled(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        if step == 0:
            grads = reduced_gradients(sync_of(model.parameters()))
        opt.step()
        opt.zero_grad()
    return {"rank": rank, "stage": 0, "dp_idx": rank, "ties": [], "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def backend_name_refusal(rank, world, options: dict):
    plan = gradsched.ParallelPlan.from_world(pp=1)
    compiled = torch.compile(TinyGPT(), backend="gradsched", fullgraph=True, options={"plan": plan, **options})
    x, y = make_batch(2, TinyGPT().config)
    try:
        lm_loss(compiled(x), y).backward()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return None


def decorated_class(rank, world, job: Job):
    """The decorator on a model class: instances come back parallel."""
    plan = gradsched.ParallelPlan.from_world(pp=job.pp)

    @gradsched.parallelize(plan=plan, loss_fn=lm_loss, split_points=job.split_points, compiler="eager")
    class GPT(TinyGPT):
        pass

    torch.manual_seed(job.seed)
    model = GPT(job.config)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, **optimizer_kwargs(job))
    dp_idx = plan.index("dp")
    per = job.global_batch // plan.dp
    for step in range(job.steps):
        x, y = make_batch(job.global_batch, job.config, seed=job.seed + 1 + step)
        model.train_step(x[dp_idx * per:(dp_idx + 1) * per], y[dp_idx * per:(dp_idx + 1) * per])
        opt.step()
    opt.finish_param_gather()  # the parameters' tensors are read directly below
    sync = model.grad_sync
    return {"rank": rank, "stage": plan.stage, "dp_idx": dp_idx, "ties": [t.members for t in sync.ties.values()],
            "params": {n: p.detach().clone() for n, p in sync.params.items()}}


class HandWrittenAttention(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, pos=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v


def hand_written_attention_under_cp(rank, world):
    plan = gradsched.ParallelPlan.from_world(cp=world)
    model = gradsched.parallelize(HandWrittenAttention(), plan=plan, compiler="eager",
                                  loss_fn=lambda out, y: (out - y).pow(2).mean())
    x = torch.randn(2, 8, 16)
    try:
        model.train_step(x, x)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return None


def padded_sequence_under_cp(rank, world, seq: int):
    """A batch of length `seq` padded with gradsched.cp.layout.pad_to_multiple (labels with ignore_index) under cp."""
    from gradsched.cp.layout import pad_to_multiple
    from tiny_gpt import GPTConfig
    plan = gradsched.ParallelPlan.from_world(cp=world)
    torch.manual_seed(0)
    model = gradsched.parallelize(TinyGPT(GPTConfig(seq=16)), plan=plan, loss_fn=lm_loss, compiler="eager")
    x, y = make_batch(4, GPTConfig(seq=seq), seed=1)
    multiple = 2 * world
    loss = model.train_step(pad_to_multiple(x, multiple), pad_to_multiple(y, multiple, value=-100))
    return {"loss": float(loss), "grads": reduced_gradients(model.grad_sync), "rank": rank}


def bf16_parameters_gathered_in_bf16(rank, world):
    """One AdamW step of a bf16 model under dp: the dtypes the optimizer all-gathers in, and whether
    every parameter is exactly its fp32 master shard rounded to bf16."""
    import gradsched.training.optimizer as optimizer
    seen = []
    gather = optimizer._all_gather

    def recording(out, x, group):
        seen.append((str(out.dtype), str(x.dtype)))
        return gather(out, x, group)
    optimizer._all_gather = recording
    plan = gradsched.ParallelPlan.from_world(pp=1)
    torch.manual_seed(0)
    model = gradsched.parallelize(TinyGPT().to(torch.bfloat16), plan=plan, loss_fn=lm_loss, compiler="eager")
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = make_batch(4, TinyGPT().config, seed=1)
    model.train_step(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
    opt.step()
    sync = model.grad_sync

    def written():  # every piece of this rank's shards is its fp32 master rounded to bf16
        return bool(opt.pieces) and all(
            torch.equal(sync.params[pc.name].detach().reshape(-1)[pc.lo:pc.hi], master.detach().to(torch.bfloat16))
            for pc, master in zip(opt.pieces, opt.masters))
    in_flight = sync.pending_gather is not None and not written()  # step() returned before the gather landed
    opt.finish_param_gather()  # the parameters' tensors are read directly below
    return {"gathers": seen, "exact": written(), "in_flight": in_flight}


class ShapeBugInSecondStage(TinyGPT):
    def forward(self, idx, pos=None):
        x = self.wte(idx)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = x @ torch.ones(7, 3)  # the user's bug, on the second stage
        return self.lm_head(self.ln_f(x))


def _message(step) -> str | None:
    try:
        step()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return None


def stage_error_messages(rank, world, compiler: str):
    """What a user sees on each rank, in order: a shape bug found while splitting; a later step
    with another batch size; a token id out of the vocabulary, inside stage 0 (which stops the
    world's process group, so it comes last). Under Inductor only the last, as the first step."""
    plan, config = gradsched.ParallelPlan.from_world(pp=2), TinyGPT().config
    x, y = make_batch(2, config)

    def parallel(cls):
        return gradsched.parallelize(cls(), plan=plan, loss_fn=lm_loss, split_points=["blocks.1"], compiler=compiler)

    bad = x.clone()
    bad[1, 5] = config.vocab + 3
    if compiler == "inductor":  # only the bad token's message is Inductor's own: its first step, nothing else compiled
        return [None, None, _message(lambda: parallel(TinyGPT).train_step(bad, y))]
    split_bug = _message(lambda: parallel(ShapeBugInSecondStage).train_step(x, y))
    model = parallel(TinyGPT)
    model.train_step(x, y)
    other_batch = _message(lambda: model.train_step(*make_batch(4, config)))
    bad_token = _message(lambda: model.train_step(bad, y))
    return [split_bug, other_batch, bad_token]


class FlashAttnGPT(TinyGPT):
    """TinyGPT whose blocks call flash-attn's flash_attn_func (the CPU stand-in) instead of SDPA."""

    def forward(self, idx, pos=None):
        from flash_attn_standin import flash_attn_func
        pos = torch.arange(idx.shape[1]) if pos is None else pos
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            B, T, C = x.shape
            q, k, v = block.qkv(block.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, block.heads, C // block.heads) for t in (q, k, v))
            x = x + block.proj(flash_attn_func(q, k, v, causal=True).reshape(B, T, C))
            x = x + block.out(torch.nn.functional.gelu(block.fc(block.ln2(x))))
        return self.lm_head(self.ln_f(x))


def flash_attn_model_under_cp(rank, world):
    plan = gradsched.ParallelPlan.from_world(cp=world)
    model = gradsched.parallelize(FlashAttnGPT(), plan=plan, loss_fn=lm_loss, compiler="eager")
    x, y = make_batch(2, TinyGPT().config)
    try:
        model.train_step(x, y)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return None



def batch_not_splitting_into_microbatches(rank, world):
    plan = gradsched.ParallelPlan.from_world()
    model = gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, microbatches=3, compiler="eager")
    x = torch.zeros(4, 16, dtype=torch.long)
    return _message(lambda: model.train_step(x, x))


def zero_loss(logits, targets):
    return (logits * 0).sum()


def decay_free_step(rank, world):
    """One AdamW step on exactly zero gradients (lr=1, weight_decay=0.5): a parameter moves only by its
    decay, so matrices are exactly halved and decay-free parameters are exactly unchanged."""
    plan = gradsched.ParallelPlan.from_world(pp=2)
    torch.manual_seed(0)
    model = gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=zero_loss, split_points=["blocks.1"],
                                  compiler="eager")
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1.0,
                                         param_groups=gradsched.weight_decay_groups(0.5))
    x, y = make_batch(4, TinyGPT().config)
    dp_idx = plan.index("dp")
    model.train_step(x[dp_idx * 2:(dp_idx + 1) * 2], y[dp_idx * 2:(dp_idx + 1) * 2])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {n: (before[n], p.detach().clone()) for n, p in model.named_parameters()}


def non_elementwise_optimizer(rank, world):
    plan = gradsched.ParallelPlan.from_world()
    model = gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, compiler="eager")
    return _message(lambda: gradsched.DistributedOptimizer(model, torch.optim.Adafactor, lr=1e-2))


def save_then_die_mid_save(rank, world, path):
    """pp2: save step 1, then die on rank 1 while the save of step 2 writes its data."""
    import os
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    plan = gradsched.ParallelPlan.from_world(pp=2)
    torch.manual_seed(0)
    model = gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, split_points=["blocks.1"], compiler="eager")
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = make_batch(2, TinyGPT().config)
    for step in (1, 2):
        model.train_step(x, y)
        opt.step()
        if step == 2 and rank == 1:
            def die_while_writing(self, plan, planner):
                os._exit(3)
            FileSystemWriter.write_data = die_while_writing
        gradsched.save(path, model, opt, step=step)
    return "saved both"


def load_messages(rank, world, cases):
    """What gradsched.load says of each (checkpoint path, TinyGPT vocabulary)."""
    from tiny_gpt import GPTConfig
    plan = gradsched.ParallelPlan.from_world()
    out = []
    for path, vocab in cases:
        model = gradsched.parallelize(TinyGPT(GPTConfig(vocab=vocab)), plan=plan, loss_fn=lm_loss, compiler="eager")
        opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        try:
            out.append({"ok": gradsched.load(path, model, opt)})
        except gradsched.CheckpointError as e:
            out.append({"error": str(e)})
    return out


def resume_runs(rank, world, runs):
    """Several tied_training.resume_main runs, one after another in this world: [(job, save_to,
    load_from, stop)]. Each builds its model, plan and optimizer anew; only checkpoints carry over."""
    from tied_training import resume_main
    out = []
    for job, save_to, load_from, stop in runs:
        torch._dynamo.reset()
        out.append(resume_main(rank, world, job, save_to, load_from, stop))
    return out


def load_after_training_started(rank, world, path, resave_to, shard=True):
    """pp2: one step, then load the checkpoint at `path` into the running stages and save it again at
    `resave_to` at once; return each rank's parameters right after the load (a step with the
    restored optimizer must run after it)."""
    from tiny_gpt import GPTConfig
    plan = gradsched.ParallelPlan.from_world(pp=2)
    torch.manual_seed(1)  # other weights than the checkpoint's
    model = gradsched.parallelize(TinyGPT(GPTConfig(vocab=97)), plan=plan, loss_fn=lm_loss,
                                  split_points=["blocks.1"], compiler="eager", microbatches=2, shard=shard)
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = make_batch(4, GPTConfig(vocab=97))
    model.train_step(x, y)
    opt.step()
    step = gradsched.load(path, model, opt)["step"]
    params = {n: p.clone() for n, p in model.grad_sync.full_parameters().items()}  # shard="params": gathered
    gradsched.save(resave_to, model, opt, step=step)
    model.train_step(x, y)
    opt.step()
    return params


def save_right_after_load(rank, world, path, to):
    """Load before the first step (the layout is not known yet), then save at once."""
    from tiny_gpt import GPTConfig
    plan = gradsched.ParallelPlan.from_world()
    model = gradsched.parallelize(TinyGPT(GPTConfig(vocab=97)), plan=plan, loss_fn=lm_loss, compiler="eager")
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    gradsched.load(path, model, opt)
    return _message(lambda: gradsched.save(to, model, opt, step=2))


def damaged_load_messages(rank, world, cases, step_after_ok: bool = True):
    """What gradsched.load says of each (checkpoint path, TinyGPT vocabulary, verify), with whether a
    refused load left the parameters as they were; after a load that succeeds, one step (the
    optimizer's state is read then)."""
    from tiny_gpt import GPTConfig
    plan = gradsched.ParallelPlan.from_world()
    out = []
    for path, vocab, verify in cases:
        torch.manual_seed(1)
        model = gradsched.parallelize(TinyGPT(GPTConfig(vocab=vocab)), plan=plan, loss_fn=lm_loss, compiler="eager")
        opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            meta = gradsched.load(path, model, opt, verify=verify)
        except gradsched.CheckpointError as e:
            out.append({"error": str(e), "untouched": all(p.equal(before[n]) for n, p in model.named_parameters())})
            continue
        if step_after_ok:
            x, y = make_batch(4, GPTConfig(vocab=vocab))
            model.train_step(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2])
            opt.step()
        out.append({"ok": meta})
    return out


def fault_in_the_optimizers_gather(rank, world, fault: str, timeout_s: float):
    """pp1 x dp2: rank 1 is SIGKILLed, SIGSTOPped, raises, or issues one extra all-reduce inside the optimizer's
    parameter all-gather of the first step; or ("raised_on_the_store_host") rank 0 raises there while rank 1
    reads posted failures 3 s late. Returns "finished" (it should not)."""
    import os
    import signal
    import time
    import gradsched.training.optimizer as optimizer
    from tied_training import batch, build_model
    import gradsched.sync.peers as peers
    if fault == "stopped":  # the same watchdog, with a shorter patience than production's 10 s + 5 s
        import gradsched.sync.watchdog as watchdog
        peers.DEAD_AFTER_S, watchdog.GRACE_S = 3.0, 2.0
    faulty_rank = 0 if fault == "raised_on_the_store_host" else 1
    if fault == "raised_on_the_store_host" and rank == 1:  # a busy peer: it reads what others posted 3 s late
        fetch = peers.fetch_failures
        peers.fetch_failures = lambda j: (time.sleep(3.0), fetch(j))
    job = Job(pp=1, dp=2, steps=1, options={"compiler": "eager", "fault_timeout_s": timeout_s})
    model, _ = build_model(job)
    model = gradsched.parallelize(model, plan=gradsched.ParallelPlan.from_world(pp=1, dp=2), loss_fn=lm_loss,
                                  **job.options)
    opt = gradsched.DistributedOptimizer(model, torch.optim.SGD, lr=0.1)
    if rank == faulty_rank:
        gather = optimizer._all_gather

        def faulty(out, x, group):
            if fault == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stopped":  # alive and silent: the launcher kills it at its deadline
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault.startswith("raised"):
                raise RuntimeError(f"injected on rank {rank}")
            torch.distributed.all_reduce(torch.zeros(3), group=group)  # "extra": its peer never issues it
            return gather(out, x, group)
        optimizer._all_gather = faulty
    x, y = batch(job, 1)
    model.train_step(x[rank::2], y[rank::2])
    opt.step()
    opt.finish_param_gather()  # where the next forward would wait for the gather step() issued
    return "finished"


def recompile_on_one_rank(rank, world, other_collectives: bool):
    """Step 0: every rank runs graph A (one all-reduce). Step 1: rank 0 runs A again, rank 1 a graph of
    its own, as after a recompile there alone: B (the same all-reduce) or C (one more all-reduce). Each
    graph compiled with Inductor through gradsched's compile_graph, its agreement on."""
    import torch.distributed as dist
    from torch._dynamo.backends.common import aot_autograd

    from gradsched.sync.compile import compile_graph
    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name

    def compiled(name, fn):
        return torch.compile(fn, fullgraph=True, backend=aot_autograd(
            fw_compiler=lambda gm, ins: compile_graph(gm, ins, "inductor", agree=f"graph {name}")))

    def reduced(x):
        return c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", group))

    def reduced_twice(x):
        y = reduced(x)
        return y + c10d.wait_tensor(c10d.all_reduce(y[:2].sum(), "sum", group))

    a = compiled("A", reduced)
    x = torch.arange(4.0) + rank
    out = [a(x)]
    try:
        if rank == 0:
            out.append(a(x))
        else:
            out.append(compiled("C", reduced_twice)(x) if other_collectives else compiled("B", reduced)(x))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"outputs": out, "error": f"{type(e).__name__}: {e}"}
    return {"outputs": out, "error": None}


def swapped_graphs_after_warm_up(rank, world):
    """Graphs A and B each all-reduce 4 floats over the world, tagged differently: two sequences of the same
    sizes, whose mixing no transport would notice. Runs 1 and 2: every rank runs A, then B (a graph's first
    run checks at once: they agree). Run 3: rank 0 runs A, rank 1 runs B, then the step's end settles.
    Returns run 3's output and what the step's end raised."""
    import torch.distributed as dist
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gradsched.passes.graph_utils import GraphBuilder
    from gradsched.sync import agreement_check
    from gradsched.sync.compile import compile_graph
    group = dist.group.WORLD.group_name

    def graph(tag):
        gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
        b = GraphBuilder(gm, FakeTensorMode())
        x = b.placeholder("x", [4], torch.float32, torch.device("cpu"))
        gm.graph.output((b.collective("all_reduce", x, group, world, {"identity": tag}),))
        gm.recompile()
        return compile_graph(gm, [torch.zeros(4)], "eager", agree=f"graph {tag}")

    a, b = graph("A"), graph("B")
    x = torch.arange(4.0) + rank
    for run in (a, b):
        run([x.clone()])
        agreement_check.settle(wait=True)
    out = (a if rank == 0 else b)([x.clone()])[0]
    try:
        agreement_check.settle(wait=True)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"output": out, "error": f"{type(e).__name__}: {e}"}
    return {"output": out, "error": None}


def uneven_batches(rank, world, job: Job, batches: list):
    """Data parallel through the backend by name, rank r's batch at step s being batches[s][r] rows
    (a new size on one rank only: Dynamo recompiles there alone). SGD over full parameters."""
    plan = gradsched.ParallelPlan.from_world(pp=1)
    torch.manual_seed(job.seed)
    model = TinyGPT(job.config)
    compiled = torch.compile(model, backend="gradsched", fullgraph=True,
                             options={"plan": plan, "shard": False, "compiler": job.options["compiler"]})
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    for step, sizes in enumerate(batches):
        x, y = make_batch(sum(sizes), job.config, seed=job.seed + 1 + step)
        lo = sum(sizes[:rank])
        lm_loss(compiled(x[lo:lo + sizes[rank]]), y[lo:lo + sizes[rank]]).backward()
        opt.step()
        opt.zero_grad()
    sync = sync_of(model.parameters())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"], "sync_runs": sync.sync_runs}


def parallelize_refusal(rank, world, options: dict):
    """What parallelize says of these options (None: accepted)."""
    try:
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan.from_world(), loss_fn=lm_loss, **options)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def bf16_parameters_sharded(rank, world):
    """shard="params" with bf16 parameters: one AdamW step; whether each of this rank's bf16 shard pieces is
    its fp32 master rounded, and whether the next forward (which gathers the shards) computes the loss an
    unsharded bf16 copy holding the gathered values computes."""
    plan = gradsched.ParallelPlan.from_world(pp=1)
    torch.manual_seed(0)
    model = gradsched.parallelize(TinyGPT().to(torch.bfloat16), plan=plan, loss_fn=lm_loss, compiler="eager",
                                  shard="params")
    opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = make_batch(4, TinyGPT().config, seed=1)
    model.train_step(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
    opt.step()
    shards = model.grad_sync.param_shards
    exact = bool(opt.pieces) and all(
        master.dtype == torch.float32 and
        torch.equal(shards.shards[pc.bucket][pc.at:pc.at + pc.numel], master.detach().to(torch.bfloat16))
        for pc, master in zip(opt.pieces, opt.masters))
    import warnings
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        full = model.state_dict()
    loss = float(model.train_step(x, y))
    torch.manual_seed(0)
    copy = TinyGPT().to(torch.bfloat16)
    copy.load_state_dict(full)
    return {"exact": exact, "loss": loss, "copy_loss": float(lm_loss(copy(x), y)),
            "state_dict_warnings": [str(w.message) for w in said]}


def init_tiny_gpt(name: str, t: torch.Tensor) -> None:
    """GPT-2's initialization by name: matrices and embeddings N(0, 0.02), biases 0, norm weights 1."""
    if name.endswith("bias"):
        t.zero_()
    elif t.dim() == 1:
        t.fill_(1.0)
    else:
        t.normal_(0.0, 0.02)


def init_tiny_llama(name: str, t: torch.Tensor) -> None:
    """tiny_llama's: RoPE's inv_freq as Llama computes it (head dim 8, theta 10000), norm weights 1, the rest
    N(0, 0.02)."""
    if name.endswith("inv_freq"):
        t.copy_(1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    elif t.dim() == 1:
        t.fill_(1.0)
    else:
        t.normal_(0.0, 0.02)


def init_forgetting_buffers(name: str, t: torch.Tensor) -> None:
    """An init for parameters only: the rotary table is left as allocated."""
    if not name.endswith("inv_freq"):
        init_tiny_llama(name, t)


def build_on_meta(model_name: str):
    """(model on meta, split points, its init)."""
    from gradsched.hf import tiny_llama
    with torch.device("meta"):
        if model_name == "tiny_gpt":
            return TinyGPT(), ["blocks.1"], init_tiny_gpt
        model, split_points = tiny_llama()
        return model, split_points, (init_tiny_llama if model_name == "hf_llama" else init_forgetting_buffers)


def meta_built_training(rank, world, pp: int, options: dict, steps: int = 2, save_dir: str = "", saved: str = "",
                        model_name: str = "tiny_gpt"):
    """The tiny tied GPT built on the meta device, allocated per stage and initialized by init_tiny_gpt, trained
    `steps` SGD steps on this rank's share of the global batch. Returns the trained state dict and what is
    on meta. save_dir: try a save before the first step, save
    there after the last; saved: allocate, then load that checkpoint before any step."""
    plan = gradsched.ParallelPlan.from_world(pp=pp)
    config = TinyGPT().config
    model, split_points, init = build_on_meta(model_name)
    options = dict(options)
    split_points = options.pop("split_points", split_points)  # zbv: four stages
    pm = gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, split_points=split_points if pp > 1 else (),
                               init_weights=init, compiler="eager", **options)
    opt = gradsched.DistributedOptimizer(pm, torch.optim.SGD, lr=0.5)
    plain = torch.optim.SGD(pm.parameters(), lr=0.5)  # over the meta Parameters: refused at its step
    refused = plain_refused = None
    if save_dir:  # before the first step nothing is allocated: a checkpoint would hold (or load into) nothing
        try:
            gradsched.save(save_dir, pm, opt, step=0)
        except gradsched.CheckpointError as e:
            refused = str(e)
    dp_idx = plan.index("dp")
    per = 8 // plan.dp
    if saved:
        x, y = make_batch(8, config)
        pm.allocate(x[:per], y[:per])
        gradsched.load(saved, pm, opt)
    for step in range(steps):
        x, y = make_batch(8, config, seed=1 + step)
        try:
            pm.train_step(x[dp_idx * per:(dp_idx + 1) * per], y[dp_idx * per:(dp_idx + 1) * per])
        except ValueError as e:  # a refusal, said on every rank before anything was sent
            return {"refused": str(e), "stage": plan.stage}
        if step == 0:
            try:
                plain.step()
            except RuntimeError as e:
                plain_refused = str(e)
        opt.step()
        opt.zero_grad()
    if save_dir:
        gradsched.save(save_dir, pm, opt, step=steps)
    return {"state": pm.state_dict(), "stage": plan.stage, "refused": refused, "plain_refused": plain_refused,
            "trained": [n for n, _ in pm.named_parameters()],
            "meta_trained": [n for n, p in pm.named_parameters() if p.is_meta],
            "unsplit_real": [n for n, p in model.named_parameters() if not p.is_meta] if pp > 1 else []}


def meta_model_without_init(rank, world):
    """A meta-built model's first step on real inputs, with no init_weights: the message."""
    with torch.device("meta"):
        model = TinyGPT()
    pm = gradsched.parallelize(model, plan=gradsched.ParallelPlan.from_world(pp=1), loss_fn=lm_loss)
    try:
        pm.train_step(*make_batch(2, model.config))
    except ValueError as e:
        return str(e)


def tensor_parallel_plan(rank, world):
    """A tp=2 plan over 2 ranks: its groups; parallelize builds over it, and the backend by name refuses it by
    name."""
    plan = gradsched.ParallelPlan.from_world(tp=2)
    out = {"describe": plan.describe(), "tp": plan.group_ranks("tp"), "grad": plan.group_ranks("grad")}
    model = TinyGPT(GPTConfig())
    out["builds"] = type(gradsched.parallelize(TinyGPT(GPTConfig()), plan=plan, loss_fn=lm_loss)).__name__
    try:
        torch.compile(model, backend="gradsched", options={"plan": plan})(make_batch(2, GPTConfig())[0])
        out["backend"] = None
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        out["backend"] = str(e)
    return out
