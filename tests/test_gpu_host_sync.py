"""On a CUDA device (`make gpu-test`): steady steps never make the host wait for the GPU, under
torch.cuda.set_sync_debug_mode("error"), but for the one read at a step's end (the non-finite flags).
One process plays rank 0 of a dp2 job on torch's fake process group, as benchmarks/memory.py
--device cuda does (its collectives move nothing, so the cross-rank agreement is off there; its
GPU half is checked on its own below)."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the GPU suite runs on a machine with one (make gpu-test)")]


@contextlib.contextmanager
def sync_is_an_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("shard,cp", [(True, 1), ("params", 1), ("params", 2)], ids=["shard", "params", "cp2_params"])
def test_steady_steps_never_wait_for_the_gpu_but_at_their_end(monkeypatch, shard, cp):
    # cp2: attention over the sequence's halves (all-gathered keys and values: the fake group moves nothing, so
    # its values are not the model's, and a step they make non-finite is skipped, which reads nothing more either)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import gradsched
    from gradsched.sync import nonfinite
    from tied_training import Job, batch, build_model
    from tiny_gpt import lm_loss

    check = nonfinite.check

    def allowed(*args, **kwargs):  # the step's one read, at its end
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return check(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.setattr(nonfinite, "check", allowed)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch._dynamo.reset()
        job = Job(pp=1, dp=2 // cp, cp=cp, steps=5)
        model, _ = build_model(job)
        cp_options = {"comm": "allgather", "on_nonfinite": "skip"} if cp > 1 else {}
        model = gradsched.parallelize(model.cuda(), plan=gradsched.ParallelPlan.from_world(pp=1, dp=2 // cp, cp=cp),
                                      loss_fn=lm_loss, microbatches=4, compiler="inductor", shard=shard,
                                      check_ranks=False, **cp_options)
        opt = gradsched.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        for step in range(job.steps):
            x, y = (t[:4].cuda() for t in batch(job, step))  # waits (pageable memory): outside the step
            with sync_is_an_error() if step >= 2 else contextlib.nullcontext():
                model.train_step(x, y)
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()


def test_the_agreement_after_its_first_run_queues_its_check_without_waiting_and_finds_a_mismatch(monkeypatch):
    from gradsched.sync import agreement_check
    from gradsched.sync.fingerprint import CollectiveMismatch

    monkeypatch.setattr(agreement_check, "_mismatch", lambda found, *a, **k: f"gathered {found}")  # no peers to name
    monkeypatch.setattr(agreement_check, "_READ", {("a group", 1234)})  # as after the digest's first run
    same, differing = torch.tensor([1234, 1234], device="cuda"), torch.tensor([1234, 99], device="cuda")
    with sync_is_an_error():
        zero = torch.ops.gradsched.agree(same, 1234, "a group")
        nan = torch.ops.gradsched.agree(differing, 1234, "a group")
        flag = agreement_check.take_step_flag(torch.device("cuda"))  # what the step's one read adds to its flags
    assert zero.item() == 0.0 and torch.isnan(nan).item() and torch.isnan(flag).item()
    with pytest.raises(CollectiveMismatch, match=r"gathered \[1234, 99\]"):
        agreement_check.settle(wait=True)
