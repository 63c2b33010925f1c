"""A steady-state step never reads a device value on the host (each read drains a GPU's queue), but for
the one at its end: the non-finite flags (gradsched.training.host_reads records the reads;
gradsched.sync.agreement_check and gradsched.training.loss_weights keep their checks on the device)."""
import pytest
import torch
from torch.optim.optimizer import _get_value

from gradsched.training import host_reads


def test_the_recorder_names_each_read_with_its_stack_and_leaves_expected_ones_out():
    t = torch.arange(3.0)
    with host_reads.recording() as seen:
        t.sum().item()
        bool(t.any())
        t.tolist()
        _get_value(torch.tensor(1.0))  # an optimizer's step counter: kept on the CPU
    assert [r.method for r in seen.unexpected()] == ["item", "__bool__", "tolist"]
    assert "test_host_reads.py" in seen.report() and "t.sum().item()" in seen.report()
    assert [r.method for r in seen.all if r.expected] == ["item"]
    assert torch.Tensor.item is not None and t.sum().item() == 3.0  # restored


# the option matrix's Inductor rows that record steps 3 to 5 (4 micro-batches; tests/conftest.py runs them once)
RECORDED = {"pp2_dp2_shard_true": "inductor_pp2_dp2_zb1p_padded_m4_clip_param_groups",
            "pp2_cp2_shard_params": "inductor_pp2_cp2_params_small_buckets_m4",
            "pp2_dp2_zbv_early_reductions": "inductor_pp2_dp2_zbv_small_buckets_m4"}  # two stages a rank, in a V


@pytest.mark.parametrize("name", list(RECORDED))
def test_steady_steps_3_to_5_read_no_device_value_on_the_host(name, inductor_runs):
    runs = inductor_runs[RECORDED[name]]
    assert not any(isinstance(r, tuple) for r in runs), runs
    for r in runs:
        assert r["reads"] == [], f"{name}, stage {r['stage']}:\n" + "\n".join(r["reads"])


@pytest.mark.parametrize("name", list(RECORDED))
def test_steady_steps_3_to_5_read_one_value_each_at_most(name, inductor_runs):
    # the non-finite flags' read, which the agreement's check now rides on too (it read each graph's digests)
    for r in inductor_runs[RECORDED[name]]:
        assert len(r["value_reads"]) == 3 and all(len(step) <= 1 for step in r["value_reads"]), \
            f"{name}, stage {r['stage']}: {r['value_reads']}"


def test_one_added_item_inside_a_step_is_caught_with_its_line(inductor_runs):
    for r in inductor_runs[RECORDED["pp2_dp2_shard_true"]]:  # the label count runs on the last stage
        assert (len(r["injected"]) >= 1) == (r["stage"] == 1), r["injected"]
        assert all("n.item()  # the injected read" in text for text in r["injected"])


def test_after_warm_up_the_agreement_reads_nothing_and_its_mismatch_reaches_the_steps_flag(monkeypatch):
    # one process: the op after a digest's first run (as the GPU suite checks on CUDA), then what the step's one
    # read adds: zero while the ranks agree, NaN once one run's digests differed; the copies compared only on demand
    from gradsched.sync import agreement_check
    from gradsched.sync.fingerprint import CollectiveMismatch
    monkeypatch.setattr(agreement_check, "_mismatch", lambda found, *a, **k: f"gathered {found}")  # no peers
    monkeypatch.setattr(agreement_check, "_READ", {("a group", 1234)})
    monkeypatch.setattr(agreement_check, "_PENDING", [])
    monkeypatch.setattr(agreement_check, "_FLAGS", {})
    same, differing = torch.tensor([1234, 1234]), torch.tensor([1234, 99])
    with host_reads.recording() as seen:
        torch.ops.gradsched.agree(same, 1234, "a group")
        agreed = agreement_check.take_step_flag(torch.device("cpu"))
        torch.ops.gradsched.agree(same, 1234, "a group")
        torch.ops.gradsched.agree(differing, 1234, "a group")
        flag = agreement_check.take_step_flag(torch.device("cpu"))
    assert seen.all == []
    assert agreed.item() == 0.0 and torch.isnan(flag).item()
    assert agreement_check.take_step_flag(torch.device("cpu")) is None  # taken: the next step starts clean
    with pytest.raises(CollectiveMismatch, match=r"gathered \[1234, 99\]"):
        agreement_check.settle(wait=True)
