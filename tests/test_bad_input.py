"""Bad input gets an error that says what was wrong and what to do."""
import pytest
import torch

import gradsched
from gradsched.launch import run_ranks
from gradsched.optimizer import mark_sharded
from gradsched.tiny_gpt import TinyGPT, lm_loss

from rank_fns import plan_errors


def test_plan_sizes_that_do_not_divide_the_world_are_refused():
    too_many_stages, wrong_dp, zero = run_ranks(plan_errors, 2)[0]
    assert "pp=3 x cp=1 does not divide the world size 2" in too_many_stages
    assert "pp=1 x dp=3 x cp=1 = 3 processes, but the world has 2" in wrong_dp
    assert "pp=0" in zero


def test_an_optimizer_built_over_full_parameters_is_refused():
    model = TinyGPT()
    with pytest.raises(TypeError, match="Pass the class and its arguments"):
        gradsched.DistributedOptimizer(model, torch.optim.AdamW(model.parameters()))


def test_an_ordinary_optimizer_over_sharded_parameters_refuses_to_step():
    model = TinyGPT()
    mark_sharded(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="gradsched.DistributedOptimizer"):
        opt.step()


def test_unknown_or_invalid_options_are_named():
    with pytest.raises(ValueError, match="unknown gradsched option.*bucket_size"):
        gradsched.SyncOptions.from_dict({"bucket_size": 4})
    with pytest.raises(ValueError, match="mode='bogus'"):
        gradsched.SyncOptions(mode="bogus")
    with pytest.raises(ValueError, match="needs shard=True"):
        gradsched.SyncOptions(mode="shard_aligned", shard=False)


def test_1f1b_with_fewer_microbatches_than_stages_names_a_schedule_that_works():
    plan = gradsched.ParallelPlan(pp=2, dp=1)  # sizes only: no process group is touched
    with pytest.raises(ValueError, match="use schedule='gpipe'"):
        gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, split_points=["blocks.1"], schedule="1f1b")


def test_a_pipeline_without_split_points_is_refused():
    with pytest.raises(ValueError, match="needs 1 split_points"):
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(pp=2, dp=1), loss_fn=lm_loss)


def test_a_batch_that_does_not_split_into_microbatches_is_refused():
    model = gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(), loss_fn=lm_loss, microbatches=3)
    x = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="batch of 4 does not split into microbatches=3"):
        model.train_step(x, x)



def test_placement_backward_with_a_tie_across_stages_is_refused_before_the_first_step():
    from gradsched.launch import RankFailed
    from gradsched.tied_training import Job, rank_main
    job = Job(pp=2, dp=1, steps=1, options={"compiler": "eager", "placement": "backward"})
    with pytest.raises(RankFailed, match="would deadlock.*placement='flush'"):
        run_ranks(rank_main, 2, job, timeout_s=120)


def test_a_stage_training_two_copies_of_one_weight_is_refused_naming_them():
    """pipelining's split can give a third use of a tied weight a copy no tie records (it names
    copies by export's choice, not always the same): the copies would drift apart."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gradsched.runtime import GradSync, TieMismatch
    g, fake = fx.Graph(), FakeTensorMode()
    phs = []
    for name in ("g_wte", "g_tok"):
        phs.append(g.placeholder(name))
        phs[-1].meta["val"] = fake.from_tensor(torch.empty(4))
    g.output(tuple(phs))
    sync = GradSync(gradsched.ParallelPlan(pp=2, dp=1), gradsched.SyncOptions(compiler="eager"), stage=0,
                    aliases=[["wte.weight", "blocks.0.tok", "lm_head.weight"]])
    params = {"wte.weight": torch.nn.Parameter(torch.zeros(4)), "blocks.0.tok": torch.nn.Parameter(torch.zeros(4))}
    with pytest.raises(TieMismatch, match=r"stage 0 trains \['blocks.0.tok', 'wte.weight'\] as separate"):
        sync.register_backward(fx.GraphModule(torch.nn.Module(), g), [], {0: "wte.weight", 1: "blocks.0.tok"}, params)
