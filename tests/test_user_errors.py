"""Errors in the user's model or split name the user's module and source line."""
import pytest

import gradsched
from gradsched.launch import run_ranks
from tiny_gpt import TinyGPT, lm_loss

from rank_fns import stage_error_messages


def test_a_split_point_that_names_no_module_is_refused_with_the_nearest_names():
    with pytest.raises(ValueError) as err:
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(pp=2, dp=1), loss_fn=lm_loss,
                              split_points=["block.1"])
    assert "['block.1'] name no submodule of TinyGPT" in str(err.value) and "'blocks.1'" in str(err.value)


@pytest.fixture(scope="module")
def messages():
    """Each rank's messages for the cases of rank_fns.stage_error_messages, under each compiler."""
    return {c: run_ranks(stage_error_messages, 2, c, raise_on_error=False) for c in ("eager", "inductor")}


def test_a_shape_bug_caught_while_splitting_names_the_users_line(messages):
    msg = messages["eager"][0][0]
    assert msg.startswith("StageError: splitting ShapeBugInSecondStage into 2 pipeline stages")
    assert "rank_fns.py" in msg and "x = x @ torch.ones(7, 3)" in msg


def test_a_later_step_with_other_shapes_is_refused_on_every_rank_before_anything_is_sent(messages):
    for rank_messages in messages["eager"]:
        assert rank_messages[1].startswith("ValueError: pp=2: the pipeline stages were split and shaped for "
                                           "micro-batches of inputs [(2, 16)] and targets (2, 16)")
        assert "this step's are [(4, 16)] and (4, 16)" in rank_messages[1]


def test_an_error_inside_a_stage_names_the_users_line_not_the_generated_code(messages):
    stage0, stage1 = (m[2] for m in messages["eager"])
    assert stage0.startswith("StageError: pipeline stage 0 of 2 failed in the model's code: IndexError: "
                             "index out of range in self")
    assert "tiny_gpt.py" in stage0 and "code: x = self.wte(idx) + self.wpe(pos)" in stage0
    assert "eval_with_key" not in stage0 and "Attempt to trace generator" not in stage0
    # the other stage, blocked on stage 0, names it and the error it posted (gradsched.sync.watchdog)
    assert stage1.startswith("CollectiveFault: rank 1/2 (pp=1/2, dp=0/1, cp=0/1) was waiting in phase 'train_step"), stage1
    assert "rank 0 (pp=0/2, dp=0/1, cp=0/1) failed: StageError: pipeline stage 0 of 2 failed in the model's code: " \
           "IndexError: index out of range in self" in stage1, stage1


def test_an_error_inside_inductors_code_gives_the_models_error_and_how_to_find_its_line(messages):
    stage0 = messages["inductor"][0][2]
    assert stage0.startswith("StageError: pipeline stage 0 of 2 failed in the model's code: RuntimeError: ")
    assert "index out of bounds" in stage0 and "inductor's compiled code, which keeps no source line; compiler='eager' names the model's line" in stage0


def test_a_frame_of_inductors_code_is_not_named_as_the_users_line_wherever_its_cache_dir_is(tmp_path, monkeypatch):
    """Clusters often move Inductor's cache (TORCHINDUCTOR_CACHE_DIR); its generated modules are still not the
    user's code: the error then says it was raised in compiled code, not a line of a cache file."""
    from gradsched.user_errors import user_frame
    generated = tmp_path / "xi" / "cxi_generated.py"
    generated.parent.mkdir()
    generated.write_text("def call():\n    raise RuntimeError('index out of bounds')\n")
    namespace = {}
    exec(compile(generated.read_text(), str(generated), "exec"), namespace)
    with pytest.raises(RuntimeError) as err:
        namespace["call"]()
    assert str(generated) in user_frame(err.value)  # outside the cache dir it passes for the user's code
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert str(generated) not in user_frame(err.value)  # the caller's line instead
