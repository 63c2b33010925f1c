"""Split points that balance the pipeline's ranks, from each piece's measured time, for an assignment of stages to ranks.

    balanced_split_points(model, example, target, loss_fn, candidates, pp, schedule) -> split_points

Why measured: an LM's first and last pieces are not blocks. The head's matmul and its loss over the vocabulary,
and a dense embedding gradient, cost what one to several blocks do, and which one depends on vocabulary, width and
device. Under a V (zbv) both sit on rank 0, so an even split of the blocks leaves rank 0 the slowest and every
other rank waiting on it (Megatron's `account_for_embedding_in_pipeline_split` counts each as one layer; DualPipe
and ZB-V papers hand-tune the first and last stage).

`measure_pieces` splits the model at every candidate (torch.distributed.pipelining, as parallelize does), runs one
micro-batch forward, the loss and the backward through the pieces in turn, and times each piece (the least of a
few runs, the device synchronised around each). Every rank measures; the times are averaged over the ranks (one
all-reduce, which also tells every rank whether one failed), and rank 0's choice is broadcast. `choose_stages` is plain arithmetic: of the ways to cut the
pieces into stages (contiguous), the one whose busiest rank (the sum of its stages, by `stage_ranks`) is the
least, then whose largest stage is the least. Under several stages a rank (a V, looped schedules) the busiest
rank's sum is not the step: which rank waits for which depends on the schedule's order (a V's order assumes its
four stages equal). There each piece is timed as F, B (its inputs' gradient) and W (timed compiled, its backward
is split in B and W as the eager piece's is: a compiled backward runs whole), and the cut whose step,
simulated in the schedule's own order (gradsched.training.schedule_simulation), is shortest wins; the first and
last stages may then hold fewer blocks, for the embedding and the head (Megatron's
num_layers_in_first/last_pipeline_stage, chosen here from measurements).
"""
from __future__ import annotations

import itertools
import math
import time
import warnings

import torch
import torch.distributed as dist

from gradsched.training.pipeline_split import check_stage_count, pass_through_skips
from gradsched.training.pipeline_schedule import SCHEDULES, stage_assignment
from gradsched.training.schedule_simulation import simulate_step
from gradsched.training.virtual_stages import stage_ranks

EXHAUSTIVE = 200_000  # cuts tried one by one up to this many; past it, the largest stage is minimised (exactly)
SIMULATED = 5_000  # the same, when each cut's step is simulated (~0.2 ms each at pp 2)


def balanced_split_points(model, example: tuple, target, loss_fn, candidates, pp: int, schedule: str = "1f1b",
                          stages_per_rank: int | None = None, repeats: int = 5,
                          compiler: str = "eager", microbatches: int | None = None) -> tuple[str, ...]:
    """The pp x (stages a rank) - 1 names of `candidates` (in the order the model runs them: the points where a
    stage may begin, e.g. every block but the first, or also inside blocks) to pass to parallelize as split_points,
    for `schedule`. `example` is one micro-batch of model inputs (a tuple), `target` its targets. Call it on every
    rank (an all-reduce when a process group is up), with real weights: it runs the model. compiler="inductor": each
    piece is timed as torch.compile runs it (Inductor speeds blocks more than an LM head: eager times then overload
    the ranks of blocks), at the cost of compiling every piece once before the timed runs. Under several stages a
    rank (V and looped schedules) the cut is the one whose step, simulated in the schedule's own order over
    `microbatches` (default 2 pp) from each piece's measured F, B and W, is shortest
    (gradsched.training.schedule_simulation)."""
    if compiler not in ("eager", "inductor"):
        raise ValueError(f"balanced_split_points: compiler={compiler!r}: 'eager' or 'inductor'.")
    if schedule not in SCHEDULES:
        raise ValueError(f"balanced_split_points: schedule={schedule!r}, not one of {SCHEDULES}.")
    if isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates):
        raise ValueError(f"balanced_split_points: candidates={candidates!r}: a list of module names, e.g. "
                         "['blocks.1', 'blocks.2'].")
    v, style = stage_assignment(schedule, stages_per_rank)
    ranks = stage_ranks(pp, v, style)
    if len(candidates) < len(ranks) - 1:
        raise ValueError(f"{len(candidates)} candidate split points cannot make {len(ranks)} stages "
                         f"({pp} ranks x {v}): give at least {len(ranks) - 1}.")
    _check_names(model, candidates)
    device = example[0].device
    error, costs = None, torch.zeros(len(candidates) + 1, 3, dtype=torch.float64, device=device)
    try:
        costs = measure_pieces(model, example, target, loss_fn, candidates, repeats, compiler)
    except Exception as e:  # noqa: BLE001 - agreed below, then raised: the other ranks would wait in the all-reduce
        error = e
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if shared:  # the times averaged over the ranks, and whether any rank failed, in one collective
        both = torch.cat([costs.reshape(-1), torch.tensor([float(error is not None)], dtype=torch.float64,
                                                          device=device)])
        dist.all_reduce(both)
        costs, failed = (both[:-1] / dist.get_world_size()).reshape(-1, 3), both[-1].item()
        if error is None and failed:
            raise ValueError(f"balanced_split_points: {int(failed)} rank(s) could not run the model's pieces (their "
                             "own error says why); nothing was split.")
    if error is not None:
        raise error
    step = None
    if v > 1:  # V and looped: the schedule's own order decides which rank waits (the busiest rank's sum does not)
        f, b, w = (costs[:, k].tolist() for k in range(3))
        m = microbatches or 2 * pp

        def step(cut):
            bounds = (0, *cut, len(f))
            per_stage = [[sum(x[a:z]) for a, z in zip(bounds, bounds[1:])] for x in (f, b, w)]
            return simulate_step(schedule, pp, v, m, *per_stage).step_s
    starts = torch.tensor(choose_stages(costs.sum(1).tolist(), ranks, step), dtype=torch.int64, device=device)
    if shared:  # rank 0's choice, whatever the last bit of another rank's sums
        dist.broadcast(starts, src=0)
    return tuple(candidates[i - 1] for i in starts.tolist())


def _check_names(model, candidates) -> None:
    """Each candidate a submodule, none twice (their order is checked where the model is split: measure_pieces)."""
    names = {name for name, _ in model.named_modules()}
    missing = [c for c in candidates if c not in names]
    if missing:
        raise ValueError(f"balanced_split_points: {missing} name no submodule of {type(model).__name__}: give module "
                         "names that begin a stage, as parallelize's split_points (e.g. 'blocks.1').")
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"balanced_split_points: candidates {list(candidates)} repeat a name: list each once.")


def _check_in_run_order(pieces, candidates) -> None:
    """Piece i + 1 begins with candidates[i]: the candidates were listed in the order the model runs them. (Not the
    order it registers them: a block may register both norms before its attention, and a stage may begin at either.)
    Out of order, each name would be given another piece's time."""
    if not all(c in dict(piece.named_modules()) for piece, c in zip(pieces[1:], candidates)):
        raise ValueError(f"balanced_split_points: candidates {list(candidates)} are not in the order the model runs "
                         "them: list them in that order.")


def choose_stages(costs: list[float], ranks: list[int], step=None) -> list[int]:
    """Where each stage but the first begins (piece indices, ascending), cutting the pieces (`costs`, in order)
    into len(ranks) contiguous stages, stage s on rank ranks[s]: the busiest rank's load least, then the largest
    stage least, then the earliest cuts; with `step` (cut -> a simulated step's seconds), the shortest step first.
    Every cut is tried up to EXHAUSTIVE of them (SIMULATED with `step`); past that (e.g. 32 layers in a V of 8
    stages: 2.6M cuts) the cut whose largest stage is least, then each boundary moved one piece at a time while
    that lowers the key: the least found that way, not always the least of all."""
    n, k = len(costs), len(ranks)
    if not 1 <= k <= n:
        raise ValueError(f"{n} pieces cannot make {k} stages.")
    if not all(math.isfinite(c) and c >= 0 for c in costs):  # NaN compares false: any cut would "win"
        raise ValueError(f"piece costs {costs}: each a finite time >= 0 (a piece's timing went wrong).")
    prefix = list(itertools.accumulate(costs, initial=0.0))

    def key(cut):
        bounds = (0, *cut, n)
        stage = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        load: dict = {}
        for s, r in enumerate(ranks):
            load[r] = load.get(r, 0.0) + stage[s]
        return (step(cut) if step is not None else 0.0, max(load.values()), max(stage), tuple(cut))

    if math.comb(n - 1, k - 1) <= (SIMULATED if step is not None else EXHAUSTIVE):
        return list(min((key(cut) for cut in itertools.combinations(range(1, n), k - 1)))[-1])
    best = key(_least_largest_stage(prefix, k))
    improved = True
    while improved:
        improved = False
        for i in range(k - 1):
            for move in (-1, 1):
                cut = list(best[-1])
                cut[i] += move
                low, high = (cut[i - 1] if i else 0), (cut[i + 1] if i < k - 2 else n)
                if low < cut[i] < high and key(cut) < best:
                    best, improved = key(cut), True
    return list(best[-1])


def _least_largest_stage(prefix: list[float], k: int) -> list[int]:
    """The cut into k contiguous stages whose largest stage is least (dynamic programming, O(k n^2))."""
    n = len(prefix) - 1
    inf = float("inf")
    worst = [[inf] * (n + 1) for _ in range(k + 1)]  # worst[j][i]: pieces 0..i-1 in j stages
    back = [[0] * (n + 1) for _ in range(k + 1)]
    worst[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for a in range(j - 1, i):
                w = max(worst[j - 1][a], prefix[i] - prefix[a])
                if w < worst[j][i]:
                    worst[j][i], back[j][i] = w, a
    cut, i = [], n
    for j in range(k, 1, -1):
        i = back[j][i]
        cut.append(i)
    return cut[::-1]


def measure_pieces(model, example: tuple, target, loss_fn, candidates, repeats: int = 3,
                   compiler: str = "eager") -> torch.Tensor:
    """[len(candidates) + 1, 3] float64 seconds: each piece's forward (F), its inputs' gradient (B) and the rest of
    its backward (W, the weights') on one micro-batch (the last piece with the loss), each the least of `repeats`
    runs after one unmeasured (noise only adds time; under compiler="inductor" it compiles each piece). Under
    compiler="inductor" the backward's B and W are split in the share the eager pieces' give: a compiled backward
    is one graph, run whole even when autograd asks for the inputs' gradient alone. The model's gradients are left
    as they were."""
    from torch.distributed.pipelining import SplitPoint, pipeline
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("balanced_split_points runs the model: build it with real weights (it was on the meta "
                         "device), or measure a copy of the same architecture.")
    marked = [model.get_submodule(c) for c in candidates]
    before = [(m, dict((k, m.__dict__[k]) for k in ("forward", "_orig_forward") if k in m.__dict__)) for m in marked]
    try:
        with torch.no_grad(), warnings.catch_warnings():  # as parallelize's split (a no_grad forward traces whole)
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            pipe = pipeline(model, mb_args=example, split_spec={c: SplitPoint.BEGINNING for c in candidates})
    finally:  # pipelining marks the split points by replacing their forward on the model itself: parallelize's
        for m, attrs in before:  # own split of the same model would then wrap them twice (and recurse)
            for k in ("forward", "_orig_forward"):
                m.__dict__.pop(k, None)
            m.__dict__.update(attrs)
    check_stage_count(pipe, candidates, type(model).__name__)
    pass_through_skips(pipe)  # each piece then takes the previous piece's outputs only
    plain = [pipe.get_stage_module(i) for i in range(len(candidates) + 1)]
    _check_in_run_order(plain, candidates)
    params = {id(p): p for m in (model, *plain) for p in m.parameters()}.values()
    pieces = plain
    if compiler == "inductor":  # each piece's own graph (a module of its own: no cache shared between pieces)
        pieces = [torch.compile(p, backend="inductor", fullgraph=True) for p in plain]
    kept = [(p, p.grad) for p in params]
    buffers = [(b, b.detach().clone()) for b in {id(b): b for m in (model, *pieces) for b in m.buffers()}.values()]
    device = example[0].device
    try:  # running statistics, the RNG and the gradients as they were (dropout, batch norm)
        # B is timed with the graph kept for the whole backward after it: Inductor's donated buffers forbid that
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch._functorch.config.patch(donated_buffer=False):
            runs = [_one_run(pieces, example, target, loss_fn, device) for _ in range(repeats + 1)][1:]
            if pieces is not plain:  # a compiled backward runs whole, the weights' gradients too, when autograd asks
                # for the inputs' alone: B and W split as the eager pieces split them (their share of the backward)
                eager = [_one_run(plain, example, target, loss_fn, device) for _ in range(repeats + 1)][1:]
                runs = _split_as(runs, eager)
    finally:
        for p, g in kept:
            p.grad = g
        with torch.no_grad():
            for b, was in buffers:
                b.copy_(was)
    return torch.tensor([[min(r[i][k] for r in runs) for k in range(3)] for i in range(len(pieces))],
                        dtype=torch.float64, device=device)


def _one_run(pieces, example, target, loss_fn, device) -> list[float]:
    """Seconds each piece took, forward and backward; each piece's inputs are leaves, so its backward stops there."""
    times, ins, outs = [], [], []
    args = example
    for piece in pieces:
        args = tuple(a.detach().requires_grad_() if a.is_floating_point() else a for a in args)
        _sync(device)
        t0 = time.perf_counter()
        out = piece(*args)
        out = out if isinstance(out, tuple) else (out,)
        if piece is pieces[-1]:
            out = (loss_fn(out[0] if len(out) == 1 else out, target),)
        _sync(device)
        times.append(time.perf_counter() - t0)
        ins.append(args)
        outs.append(out)
        args = out
    grads, inputs_only, whole = None, [0.0] * len(pieces), [0.0] * len(pieces)
    for i in reversed(range(len(pieces))):
        pairs = [(o, g) for o, g in zip(outs[i], grads or [None] * len(outs[i]))
                 if isinstance(o, torch.Tensor) and o.requires_grad and (g is not None or grads is None)]
        wanted = [a for a in ins[i] if isinstance(a, torch.Tensor) and a.requires_grad]
        if pairs and wanted:  # the inputs' gradient alone (a zero-bubble schedule's B): autograd skips the weights'
            _sync(device)
            t0 = time.perf_counter()
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs] if grads is not None else None,
                                retain_graph=True, allow_unused=True)
            _sync(device)
            inputs_only[i] = time.perf_counter() - t0
        _sync(device)
        t0 = time.perf_counter()
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs] if grads is not None else None)
        _sync(device)
        whole[i] = time.perf_counter() - t0
        grads = [a.grad if isinstance(a, torch.Tensor) else None for a in ins[i]]
    # W: what the whole backward takes beyond the inputs' gradient (it computes that again: an estimate)
    return [(f, min(b, g), max(g - b, 0.0)) for f, b, g in zip(times, inputs_only, whole)]


def _split_as(runs: list, eager: list) -> list:
    """Each compiled run's backward (B + W) split in B and W in the share the eager runs' least times give."""
    share = []
    for i in range(len(eager[0])):
        b, w = min(r[i][1] for r in eager), min(r[i][2] for r in eager)
        share.append(b / (b + w) if b + w > 0 else 0.0)
    return [[(f, (b + w) * q, (b + w) * (1 - q)) for (f, b, w), q in zip(run, share)] for run in runs]


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
