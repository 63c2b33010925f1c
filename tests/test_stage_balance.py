"""balanced_split_points: the split that balances the ranks for an assignment of stages to ranks, from measured pieces."""
import random

import pytest
import torch
import torch.nn as nn

from gradsched.training.stage_balance import _least_largest_stage, balanced_split_points, choose_stages
from gradsched.training.virtual_stages import stage_ranks


def test_one_stage_a_rank_moves_blocks_off_a_heavy_last_stage():
    # seven blocks and a head costing five: an even 4 | 4 split loads the last rank 8, this one 6 | 6
    assert choose_stages([1.0] * 7 + [5.0], stage_ranks(2, 1, "loop")) == [6]


def test_a_v_gives_its_first_rank_short_first_and_last_stages():
    # an embedding and a head costing three blocks each: under the V both are rank 0's, so rank 0 takes no block
    # (the even cut 2, 4, 6 loads rank 0 with 8 of 12)
    assert choose_stages([3.0] + [1.0] * 6 + [3.0], stage_ranks(2, 2, "v")) == [1, 4, 7]


def test_looped_stages_balance_each_ranks_sum_not_each_stage():
    # rank 0 holds stages 0 and 2: a heavy first piece is offset by a short third stage
    costs = [4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    cut = choose_stages(costs, stage_ranks(2, 2, "loop"))
    bounds = [0, *cut, len(costs)]
    stages = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(stages[0] + stages[2], stages[1] + stages[3]) == 6.0  # of 12: the best any cut can do


def test_the_fallback_for_many_pieces_finds_the_least_largest_stage_that_trying_every_cut_finds():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(2, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(n)]
        exhaustive = choose_stages(costs, list(range(k)))  # one stage a rank: the busiest rank is the largest stage
        prefix = [sum(costs[:i]) for i in range(n + 1)]
        dp = _least_largest_stage(prefix, k)

        def largest(cut):
            b = [0, *cut, n]
            return max(prefix[j] - prefix[i] for i, j in zip(b, b[1:]))
        assert len(dp) == k - 1 and dp == sorted(set(dp)) and largest(dp) == largest(exhaustive)


class Wide(nn.Module):
    """Four small blocks and a head 32 times as wide: the head's piece costs several blocks."""
    def __init__(self, dim: int = 32, vocab: int = 2048):
        super().__init__()
        self.emb = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


def _loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def test_the_measured_split_moves_blocks_off_the_heavy_head_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = Wide()
    x, y = torch.randint(0, 64, (2, 256)), torch.randint(0, 2048, (2, 256))
    before = model(x).detach()
    split = balanced_split_points(model, (x,), y, _loss, ["blocks.1", "blocks.2", "blocks.3"], pp=2)
    assert split == ("blocks.3",)  # the head's stage holds one block, not the even two: the head costs ~60 blocks
    assert all(p.grad is None for p in model.parameters())
    # parallelize splits the same model again: pipelining's marks of the split points must not have stayed on it
    from torch.distributed.pipelining import SplitPoint, pipeline
    pipe = pipeline(model, mb_args=(x,), split_spec={"blocks.2": SplitPoint.BEGINNING})
    assert torch.equal(pipe.get_stage_module(1)(pipe.get_stage_module(0)(x)), before)
    assert torch.equal(model(x), before)


def test_timed_as_inductor_compiles_the_pieces_the_heavy_head_still_gets_one_block_and_the_model_is_untouched():
    torch.manual_seed(0)
    model = Wide()
    x, y = torch.randint(0, 64, (2, 256)), torch.randint(0, 2048, (2, 256))
    before = model(x).detach()
    split = balanced_split_points(model, (x,), y, _loss, ["blocks.1", "blocks.2", "blocks.3"], pp=2, repeats=2,
                                  compiler="inductor")
    assert split == ("blocks.3",) and all(p.grad is None for p in model.parameters())
    assert torch.equal(model(x), before)
    with pytest.raises(ValueError, match="compiler='aot_eager': 'eager' or 'inductor'"):
        balanced_split_points(model, (x,), y, _loss, ["blocks.1"], pp=2, compiler="aot_eager")


def test_timed_as_inductor_a_blocks_backward_is_split_in_b_and_w_not_all_b():
    """A compiled backward runs whole even when autograd asks for the inputs' gradient alone: timed so, B was the
    whole backward and W nothing, and the simulated V and looped schedules saw no W to fill their waits with."""
    from gradsched.training.stage_balance import measure_pieces
    torch.manual_seed(0)
    model = Wide(dim=384, vocab=64)  # blocks of 384 x 384: each half of a block's backward takes ~1 ms here
    x, y = torch.randint(0, 64, (4, 512)), torch.randint(0, 64, (4, 512))
    costs = measure_pieces(model, (x,), y, _loss, ["blocks.1", "blocks.2", "blocks.3"], repeats=3, compiler="inductor")
    for f, b, w in costs[1:3].tolist():  # the middle pieces: a block each, its input a hidden state
        assert 0.2 < w / (b + w) < 0.8, (f, b, w)  # x @ W: the inputs' gradient and the weight's cost alike
    assert costs[0, 1] == 0  # the first piece's input is token ids: no inputs' gradient


def test_past_the_exhaustive_limit_the_v_still_balances_its_ranks(monkeypatch):
    import gradsched.training.stage_balance as sb
    costs, ranks = [3.0] + [1.0] * 7, stage_ranks(2, 2, "v")
    exhaustive = choose_stages(costs, ranks)
    monkeypatch.setattr(sb, "EXHAUSTIVE", 0)  # the fallback: least largest stage, then one boundary at a time
    fallback = choose_stages(costs, ranks)

    def busiest(cut):
        b = [0, *cut, len(costs)]
        stage = [sum(costs[i:j]) for i, j in zip(b, b[1:])]
        return max(stage[0] + stage[3], stage[1] + stage[2])
    # the least largest stage alone ([1, 2, 5]) loads rank 0 with 6 of 10
    assert busiest(sb._least_largest_stage([sum(costs[:i]) for i in range(9)], 4)) == 6.0
    assert busiest(fallback) == busiest(exhaustive) == 5.0


def test_candidates_out_of_the_order_the_model_runs_them_or_unknown_are_refused_before_any_piece_is_timed():
    import pytest
    model = Wide()
    x, y = torch.randint(0, 64, (1, 8)), torch.randint(0, 2048, (1, 8))
    with pytest.raises(ValueError, match="not in the order the model runs them"):
        balanced_split_points(model, (x,), y, _loss, ["blocks.2", "blocks.1"], pp=2)
    with pytest.raises(ValueError, match=r"\['blocks.9'\] name no submodule"):
        balanced_split_points(model, (x,), y, _loss, ["blocks.1", "blocks.9"], pp=2)


def test_candidates_inside_a_block_in_the_order_it_runs_them_not_the_order_it_registers_them_are_cut_there():
    from tiny_gpt import GPTConfig, TinyGPT, lm_loss
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2))
    x, y = torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16))
    runs = ["blocks.0.proj", "blocks.0.ln2", "blocks.1", "blocks.1.proj", "blocks.1.ln2"]  # ln2 registers before proj
    chosen = balanced_split_points(model, (x,), y, lm_loss, runs, pp=2, repeats=1)
    assert len(chosen) == 1 and chosen[0] in runs
    with pytest.raises(ValueError, match="not in the order the model runs them"):
        balanced_split_points(model, (x,), y, lm_loss, ["blocks.0.ln2", "blocks.0.proj"], pp=2, repeats=1)


def test_an_unknown_schedule_or_a_string_of_candidates_is_refused():
    import pytest
    model = Wide()
    x, y = torch.randint(0, 64, (1, 8)), torch.randint(0, 2048, (1, 8))
    with pytest.raises(ValueError, match=r"schedule='ZBV', not one of"):
        balanced_split_points(model, (x,), y, _loss, ["blocks.1"], pp=2, schedule="ZBV")
    with pytest.raises(ValueError, match="a list of module names"):
        balanced_split_points(model, (x,), y, _loss, "blocks.1", pp=2)


def test_a_nan_or_infinite_piece_cost_is_refused_rather_than_cut_arbitrarily():
    import pytest
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="each a finite time >= 0"):
            choose_stages([1.0, bad, 1.0, 1.0], stage_ranks(2, 1, "loop"))
