"""Bad input gets an error that says what was wrong and what to do."""
import re

import pytest
import torch

import gradsched
from gradsched.options import SyncOptions
from gradsched.launch import run_ranks
from gradsched.sync.owners import mark_sharded
from gradsched.sync.ties import TieMismatch, check_one_copy_per_stage, shared_parameters
from tiny_gpt import GPTConfig, TinyGPT, lm_loss, make_batch

from rank_fns import plan_errors, tensor_parallel_plan


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
    with pytest.raises(ValueError, match=r"fault_timeout_s=0 must be > 0 \(seconds\)"):
        gradsched.SyncOptions(fault_timeout_s=0)
    for bad in ("docs", 1, None):
        with pytest.raises(ValueError, match=f"load_balance={bad!r} is not one of"):
            gradsched.SyncOptions(load_balance=bad)


@pytest.mark.parametrize("options, says", [
    ({"reshard_after_forward": False}, "reshard_after_forward=False is for shard='params'"),
    ({"bucket_mb": 0}, r"bucket_mb=0 must be > 0"),
    ({"microbatches": 0}, r"microbatches=0 must be >= 1"),
    ({"shard": "yes"}, r"shard='yes' is not one of"),
    ({"a2a_degree": 2}, r"a2a_degree=2 is for comm='hybrid'"),
    ({"comm": "hybrid", "a2a_degree": 0}, r"a2a_degree=0 must be >= 1"),
    ({"compile_timeout_s": 0}, r"compile_timeout_s=0 must be > 0 \(seconds\)"),
    ({"on_nonfinite": "ignore"}, r"on_nonfinite='ignore' is not one of"),
    ({"tp_plan": {"blocks.*.fc": "rowwise"}}, r"tp_plan=\{'blocks.\*.fc': 'rowwise'\}: a module-name pattern"),
])
def test_each_option_out_of_its_range_is_refused_naming_it_before_any_collective(options, says):
    with pytest.raises(ValueError, match=says):
        gradsched.SyncOptions(**options)


@pytest.mark.parametrize("plan, options, says", [
    ({"pp": 2}, {}, "pp=2: pipeline stages need a schedule"),
    ({"cp": 2}, {}, "cp=2: context parallelism shards the sequence"),
    ({"dp": 2}, {"microbatches": 2}, "microbatches=2: only a driver knows which backward ends a step"),
    ({"dp": 2}, {"placement": "flush"}, "placement='flush': nothing would call the flush"),
    ({"dp": 2}, {"shard": "params"}, "shard='params': the model's own parameters would be left without storage"),
])
def test_the_backend_by_name_refuses_what_only_a_driver_runs_and_names_parallelize(plan, options, says):
    """Refused as the first graph compiles, before any collective (the plan holds no process group here)."""
    compiled = torch.compile(TinyGPT(GPTConfig()), backend="gradsched",
                             options={"plan": gradsched.ParallelPlan(**plan), "compiler": "eager", **options})
    with pytest.raises(Exception, match=f"alone cannot run {re.escape(says)}.*Use gradsched.parallelize"):
        compiled(torch.zeros(1, 8, dtype=torch.long))


def test_the_document_balanced_layout_refuses_a_model_that_cannot_take_seq_idx():
    plan = gradsched.ParallelPlan(pp=1, dp=1, cp=2)  # sizes only: no process group is touched
    with pytest.raises(ValueError, match="load_balance='documents' calls TinyGPT with"):
        gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, load_balance="documents")


def test_1f1b_with_fewer_microbatches_than_stages_names_a_schedule_that_works():
    plan = gradsched.ParallelPlan(pp=2, dp=1)  # sizes only: no process group is touched
    with pytest.raises(ValueError, match="use the gpipe schedule, or 2 micro-batches or more"):
        gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, split_points=["blocks.1"], schedule="1f1b")


def test_zero_bubble_refuses_micro_batches_it_cannot_run_in_equal_rounds_and_a_model_without_a_pipeline():
    plan = gradsched.ParallelPlan(pp=2, dp=1)  # sizes only: no process group is touched
    with pytest.raises(ValueError, match=r"5 micro-batches do not divide into them\. Use a multiple of 2"):
        gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, split_points=["blocks.1"], schedule="zb1p",
                              microbatches=5)
    with pytest.raises(ValueError, match=r"zb1p schedule needs at least as many micro-batches as pipeline stages "
                                         r"\(1 < pp 2\)"):
        gradsched.parallelize(TinyGPT(), plan=plan, loss_fn=lm_loss, split_points=["blocks.1"], schedule="zb1p")
    with pytest.raises(ValueError, match="zb1p is a pipeline schedule: with pp 1 there is no pipeline"):
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(pp=1, dp=2), loss_fn=lm_loss, schedule="zb1p")


def test_several_stages_a_rank_refuse_sizes_and_options_they_cannot_run_before_any_collective():
    model = TinyGPT(GPTConfig(layers=4))
    splits = ["blocks.1", "blocks.2", "blocks.3"]
    plan = gradsched.ParallelPlan(pp=2, dp=1)  # sizes only: no process group is touched
    for kwargs, message in (
            ({"schedule": "zbv", "split_points": ["blocks.2"], "microbatches": 4},
             r"pp=2 x stages_per_rank=2 needs 3 split_points"),
            ({"schedule": "zbv", "split_points": splits, "microbatches": 2}, r"at least 2 pp - 1 = 3 micro-batches"),
            ({"schedule": "zbv", "split_points": splits, "microbatches": 4, "stages_per_rank": 3}, "two stages a rank"),
            ({"schedule": "dualpipev", "split_points": splits, "microbatches": 3}, r"as stages, 2 pp = 4"),
            ({"schedule": "1f1b", "split_points": splits, "microbatches": 4, "stages_per_rank": 2},
             "needs a schedule that runs several"),
            ({"schedule": "interleaved_1f1b", "split_points": ["blocks.2"], "microbatches": 4, "stages_per_rank": 1},
             "stages_per_rank >= 2"),
            ({"schedule": "zbv", "split_points": splits, "microbatches": 4, "placement": "backward"},
             "placement='backward'"),
            ({"schedule": "interleaved_1f1b", "split_points": splits, "microbatches": 4}, None),
            ({"schedule": "zbv", "split_points": splits, "microbatches": 4, "shard": "params"}, None)):
        if message is None:  # accepted: refused only later for want of process groups
            with pytest.raises(Exception, match="process group|init_process_group|no process groups"):
                gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, **kwargs).local
            continue
        with pytest.raises(ValueError, match=message):
            gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, **kwargs)


def test_a_pipeline_without_split_points_is_refused():
    with pytest.raises(ValueError, match="needs 1 split_points"):
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(pp=2, dp=1), loss_fn=lm_loss)


def test_a_batch_that_does_not_split_into_microbatches_is_refused():
    from rank_fns import batch_not_splitting_into_microbatches
    [message] = run_ranks(batch_not_splitting_into_microbatches, 1)
    assert "ValueError: batch of 4 does not split into microbatches=3" in message


def test_a_plan_built_without_process_groups_is_refused_when_the_model_is_parallelized():
    with pytest.raises(gradsched.PlanError, match="no process groups.*from_world"):
        gradsched.parallelize(TinyGPT(), plan=gradsched.ParallelPlan(), loss_fn=lm_loss)



def test_placement_backward_with_a_tie_across_stages_is_refused_before_the_first_step():
    from gradsched.launch import RankFailed
    from tied_training import Job, rank_main
    job = Job(pp=2, dp=1, steps=1, options={"compiler": "eager", "placement": "backward"})
    with pytest.raises(RankFailed, match="would deadlock.*placement='tied_at_flush'"):
        run_ranks(rank_main, 2, job, timeout_s=120)



class ThirdUse(TinyGPT):
    """The tied embedding read a third time, by the middle block's code (ALBERT-style reuse)."""

    def __init__(self):
        super().__init__(GPTConfig(layers=3))
        self.blocks[1].emb_w = self.wte.weight

    def forward(self, idx, pos=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
            if hasattr(block, "emb_w"):
                x = x + 0.1 * torch.nn.functional.linear(torch.tanh(x @ block.emb_w.t()), block.emb_w.t())
        return self.lm_head(self.ln_f(x))


def split(model, point):
    from torch.distributed.pipelining import SplitPoint, pipeline
    x, _ = make_batch(2, model.config)
    with torch.no_grad():
        return pipeline(model, mb_args=(x,), split_spec={point: SplitPoint.BEGINNING})


def refusal_of_third_use() -> str:
    """Split ThirdUse at blocks.2 and check stage 0 (run in a subprocess with a fixed hash seed)."""
    pipe = split(ThirdUse(), "blocks.2")
    try:
        check_one_copy_per_stage(pipe.get_stage_module(0), 0, shared_parameters(ThirdUse()))
    except TieMismatch as e:
        return str(e)
    return "accepted"


def test_a_stage_reading_two_copies_of_one_weight_after_the_split_is_refused():
    """pipelining gives the third use a copy of its own and records no tie for it: its gradient would
    never be summed with the others. Whether it does depends on export's naming, which follows
    Python's hash seed: seed 0 is one that splits the copies."""
    import os
    import subprocess
    import sys
    code = "import test_bad_input as t; print(t.refusal_of_third_use())"
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")  # tiny_gpt
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(__file__),
                         env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": examples}).stdout
    assert "stage 0 reads one weight of the model (named wte.weight, blocks.1.emb_w, lm_head.weight) " \
           "through 2 separate copies" in out


def test_the_stale_copy_the_split_leaves_of_a_tied_head_is_not_a_second_copy():
    pipe = split(TinyGPT(), "blocks.1")
    for stage in (0, 1):
        check_one_copy_per_stage(pipe.get_stage_module(stage), stage, shared_parameters(TinyGPT()))


def test_a_value_read_two_stages_back_is_passed_through_the_stages_between_else_refused_naming_both():
    from torch.distributed.pipelining import SplitPoint, pipeline

    from gradsched.hf import tiny_llama
    from gradsched.training.pipeline_split import check_adjacent_stages, pass_through_skips
    from gradsched.user_errors import StageError

    def split(model, points):
        with torch.no_grad():
            return pipeline(model, mb_args=(torch.randint(0, 64, (1, 16)),),
                            split_spec={p: SplitPoint.BEGINNING for p in points})
    check_adjacent_stages(split(TinyGPT(GPTConfig(layers=4)), ["blocks.1", "blocks.2", "blocks.3"]), "TinyGPT")
    # Llama's rotary embeddings: computed in stage 0, read by every layer (a fresh model a split: it traces it)
    check_adjacent_stages(split(tiny_llama(layers=4)[0], ["model.model.layers.2"]), "CausalLM")  # 2 stages: adjacent
    llama, _ = tiny_llama(layers=4)
    pipe = split(llama, [f"model.model.layers.{i}" for i in (1, 2, 3)])
    with pytest.raises(StageError, match="stage 2 reads a value stage 0 computes"):
        check_adjacent_stages(pipe, "CausalLM")
    # passed through stages 1 and 2 (each returns it with its own output): adjacent, and the same output
    assert pass_through_skips(pipe) == 2 * 2  # two tensors (cos, sin), each through stages 1 and 2
    check_adjacent_stages(pipe, "CausalLM")
    x = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        assert torch.equal(pipe(x)[0], llama(x))


def test_the_old_placement_name_split_still_works_with_a_warning_naming_its_new_name():
    with pytest.warns(FutureWarning, match="placement='tied_at_flush'"):
        opts = SyncOptions(placement="split")
    assert opts.placement == "tied_at_flush"


def test_a_tensor_parallel_plan_lays_out_its_groups_and_the_backend_by_name_refuses_it_by_name():
    r0, r1 = run_ranks(tensor_parallel_plan, 2)
    assert r0["describe"] == "rank 0/2 (pp=0/1, dp=0/1, cp=0/1, tp=0/2)" and r1["tp"] == (0, 1)
    assert r0["grad"] == (0,) and r1["grad"] == (1,)  # each TP index reduces its own shard's gradients
    for r in (r0, r1):
        assert r["builds"] == "ParallelModel"  # tp x dp (x pp) steps train (tests/test_tp_training.py)
        assert r["backend"] is not None and "tp=2" in r["backend"] and "gradsched.parallelize" in r["backend"], \
            r["backend"]


def test_a_tp_plan_that_names_no_module_or_a_role_that_does_not_exist_is_refused_before_any_collective():
    model = TinyGPT(GPTConfig())
    for plan, tp_plan, message in (
            (gradsched.ParallelPlan(tp=2), {"blocks.*.mlp": "row"}, r"'blocks.\*.mlp' names no module of TinyGPT"),
            (gradsched.ParallelPlan(tp=2), {"blocks.*.fc": "rowwise"}, r"one of \('column', 'row', 'replicated'\)"),
            (gradsched.ParallelPlan(dp=1), {"blocks.*.fc": "replicated"}, "the plan has tp=1")):
        with pytest.raises(ValueError, match=message):
            gradsched.parallelize(model, plan=plan, loss_fn=lm_loss, tp_plan=tp_plan)
