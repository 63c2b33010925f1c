"""Per-rank bodies of tests/test_vocab_parallel_loss.py: the loss after a pipeline's last stage, on each TP rank's
vocabulary columns of the logits, against the same loss on the whole logits in one process (float64)."""
import warnings

import torch
import torch.nn.functional as F

import gradsched
from gradsched.training.vocab_parallel_loss import VocabParallelLoss
from tied_training import abs_diff
from tp_fns import smoothed_loss


def z_loss(logits, targets):
    """A cross-entropy plus a penalty on each row's log-sum-exp: it reads every column, so no TP rank can compute
    it from its own (the logits are gathered for it)."""
    flat = logits.flatten(0, 1)
    return F.cross_entropy(flat, targets.flatten()) + 1e-2 * flat.logsumexp(-1).square().mean()


LOSSES = {"smoothed": smoothed_loss, "z_loss": z_loss}


def case(rank: int, world: int, loss: str) -> dict:
    """One micro-batch's gated loss (kept, weight 0.25) and its gradient to this rank's columns; the warnings the
    first call gave."""
    plan = gradsched.ParallelPlan.from_world(tp=world)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 32, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 32, (2, 8), generator=g)
    keep, weight = torch.ones(1, dtype=torch.bool), torch.full((1,), 0.25, dtype=torch.float64)
    whole = logits.clone().requires_grad_()
    want = LOSSES[loss](whole, targets) * 0.25
    want.backward()
    n, t = 32 // world, plan.index("tp")
    local = logits[..., t * n:(t + 1) * n].clone().requires_grad_()
    split = VocabParallelLoss(LOSSES[loss], plan, "eager")
    split.outputs.append(2)  # as the backend reports a last stage whose logits it left split along dim 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = split(local, targets, keep, weight)
    got.backward()
    return {"loss": abs_diff(got.detach(), want.detach()),
            "grad": abs_diff(local.grad, whole.grad[..., t * n:(t + 1) * n]),
            "split": list(split.shapes), "warnings": [str(w.message) for w in seen if "gradsched" in str(w.message)]}


def cases(rank: int, world: int, names: list) -> dict:
    return {name: case(rank, world, name) for name in names}
