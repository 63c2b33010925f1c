"""Checkpoints: independent of the layout, atomic, and refused by name when they do not fit.

The reference for resuming is the same parallel run, never stopped; both end in a
checkpoint, read back whole in this process by DCP itself, and compared tensor by tensor
(parameters, fp32 master weights and the optimizer's moments). The runs share one set of
processes (start-up dominates); each builds its model, plan and optimizer anew, and only the
checkpoint carries over. benchmarks/resume_parity.py stops every process between the halves."""
import os

import pytest

from gradsched.launch import RankFailed, run_ranks
from rank_fns import (load_after_training_started, load_messages, resume_runs, save_right_after_load,
                      save_then_die_mid_save)
from tied_training import Job, checkpoint_contents, max_state_diff
from tiny_gpt import GPTConfig


def job(pp, dp, **options):
    return Job(pp=pp, dp=dp, optimizer="adamw", config=GPTConfig(vocab=97), param_groups="decay_matrices",
               options={"compiler": "eager", "microbatches": 2, **options})


RESUMED_AT = {  # name -> (the second half's layout, tolerance)
    "same_layout": (job(2, 2), 1e-6),
    "pp1_dp4": (job(1, 4), 1e-5),  # other reduction groups: fp32 sums in another order
    "other_bucket_mb": (job(2, 2, bucket_mb=0.004), 1e-6),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    plan = [(job(2, 2), str(d / "uninterrupted"), None, 4), (job(2, 2), str(d / "first_half"), None, 2)]
    plan += [(layout, str(d / name), str(d / "first_half"), 4) for name, (layout, _) in RESUMED_AT.items()]
    per_rank = run_ranks(resume_runs, 4, plan, timeout_s=600)
    return d, [r["start"] for r in per_rank[0]]


@pytest.mark.parametrize("name", list(RESUMED_AT))
def test_a_run_resumed_at_any_layout_continues_as_if_never_stopped(name, runs):
    d, starts = runs
    assert starts[2 + list(RESUMED_AT).index(name)] == 2  # it read the data position back
    resumed = checkpoint_contents(str(d / name))
    assert any(k.endswith("/exp_avg_sq") for k in resumed)  # the moments are compared, not only weights
    assert max_state_diff(checkpoint_contents(str(d / "uninterrupted")), resumed) <= RESUMED_AT[name][1]


def test_a_crash_mid_save_leaves_the_last_checkpoint_loadable_and_the_partial_one_refused(tmp_path, runs):
    with pytest.raises(RankFailed):
        run_ranks(save_then_die_mid_save, 2, str(tmp_path), timeout_s=120, collective_timeout_s=20)
    assert os.path.isdir(tmp_path / "step-00000002.partial")
    d, _ = runs
    last, partial, other_model = run_ranks(load_messages, 1, [
        (str(tmp_path), 64), (str(tmp_path / "step-00000002.partial"), 64), (str(d / "first_half"), 96)])[0]
    assert last["ok"]["step"] == 1
    assert "is incomplete: its save did not finish" in partial["error"]
    # a checkpoint of another model is refused, naming what differs
    assert "is not of this model" in other_model["error"]
    assert "wte.weight: saved (97, 32), model (96, 32)" in other_model["error"]


def test_a_checkpoint_loaded_into_running_stages_reaches_every_copy_and_saves_again_unchanged(runs, tmp_path):
    d, _ = runs
    saved = checkpoint_contents(str(d / "first_half"))
    for params in run_ranks(load_after_training_started, 2, str(d / "first_half"), str(tmp_path)):
        for name, p in params.items():  # stage 1's head is the embedding's copy, saved under its first name
            assert p.equal(saved[f"model/{'wte.weight' if name == 'lm_head.weight' else name}"]), name
    # saved again before any step (at pp2 x dp1, from a pp2 x dp2 checkpoint): the same state
    assert max_state_diff(saved, checkpoint_contents(str(tmp_path))) == 0.0


def test_saving_a_loaded_checkpoint_before_the_layout_is_known_is_refused_not_written_without_state(runs, tmp_path):
    d, _ = runs
    [message] = run_ranks(save_right_after_load, 1, str(d / "first_half"), str(tmp_path))
    assert message.startswith("CheckpointError: gradsched.save after gradsched.load, before the model's first step")
    assert not (tmp_path / "latest").exists()
