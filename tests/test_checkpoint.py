"""Checkpoints: independent of the layout, atomic, and refused by name when they do not fit.

The reference for resuming is the same parallel run, never stopped; both end in a
checkpoint, read back whole in this process by DCP itself, and compared tensor by tensor
(parameters, fp32 master weights and the optimizer's moments)."""
import os

import pytest

from gradsched.launch import RankFailed, run_ranks
from rank_fns import load_message, save_then_die_mid_save
from tied_training import Job, checkpoint_contents, max_state_diff, resume_main
from tiny_gpt import GPTConfig


def job(pp, dp, **options):
    return Job(pp=pp, dp=dp, optimizer="adamw", config=GPTConfig(vocab=97), param_groups="decay_matrices",
               options={"compiler": "eager", "microbatches": 2, **options})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("uninterrupted"))
    run_ranks(resume_main, 4, job(2, 2), path, None, 4, timeout_s=300)
    return checkpoint_contents(path)


@pytest.fixture(scope="module")
def saved_at_pp2_dp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("first_half"))
    run_ranks(resume_main, 4, job(2, 2), path, None, 2, timeout_s=300)
    return path


@pytest.mark.parametrize("layout,tol", [
    (job(2, 2), 1e-6),
    (job(1, 4), 1e-5),  # other reduction groups: fp32 sums in another order
    (job(2, 2, bucket_mb=0.004), 1e-6),
], ids=["same_layout", "pp1_dp4", "other_bucket_mb"])
def test_a_run_resumed_at_any_layout_continues_as_if_never_stopped(layout, tol, uninterrupted, saved_at_pp2_dp2,
                                                                    tmp_path):
    results = run_ranks(resume_main, 4, layout, str(tmp_path), saved_at_pp2_dp2, 4, timeout_s=300)
    assert all(r["start"] == 2 for r in results)
    resumed = checkpoint_contents(str(tmp_path))
    assert any(k.endswith("/exp_avg_sq") for k in resumed)  # the moments are compared, not only weights
    assert max_state_diff(uninterrupted, resumed) <= tol


def test_a_crash_mid_save_leaves_the_last_checkpoint_loadable_and_the_partial_one_refused(tmp_path):
    with pytest.raises(RankFailed):
        run_ranks(save_then_die_mid_save, 4, str(tmp_path), timeout_s=120, collective_timeout_s=20)
    assert os.path.isdir(tmp_path / "step-00000002.partial")
    [ok] = run_ranks(load_message, 1, str(tmp_path), 64)
    assert ok["ok"]["step"] == 1
    [partial] = run_ranks(load_message, 1, str(tmp_path / "step-00000002.partial"), 64)
    assert "is incomplete: its save did not finish" in partial["error"]


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(saved_at_pp2_dp2):
    [other] = run_ranks(load_message, 1, saved_at_pp2_dp2, 96)
    assert "is not of this model" in other["error"]
    assert "wte.weight: saved (97, 32), model (96, 32)" in other["error"]
