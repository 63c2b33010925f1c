"""Errors in the user's model or split name the user's module and source line."""
import pytest

import gradsched
from gradsched.launch import run_ranks
from gradsched.tiny_gpt import TinyGPT, lm_loss

from rank_fns import stage_error_message


def test_a_split_point_that_names_no_module_is_refused_with_the_nearest_names():
    with pytest.raises(ValueError) as err:
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(pp=2, dp=1), loss_fn=lm_loss,
                              split_points=["block.1"])
    assert "['block.1'] name no submodule of TinyGPT" in str(err.value) and "'blocks.1'" in str(err.value)


def test_a_shape_bug_caught_while_splitting_names_the_users_line():
    msg = run_ranks(stage_error_message, 2, "ShapeBugInSecondStage", raise_on_error=False)[0]
    assert msg.startswith("StageError: splitting ShapeBugInSecondStage into 2 pipeline stages")
    assert "rank_fns.py" in msg and "x = x @ torch.ones(7, 3)" in msg

