"""A stage's setup and its compile-time refusals: plain data in, a decision or a clear error out."""
import pytest
import torch

from gradsched.passes.grad_ready_order import GradSpec
from gradsched.sync.preflight import check_backward_graph
from gradsched.sync.stage_setup import StageSetup, resolve_placement
from gradsched.sync.sync_plan import Group
from gradsched.sync.ties import Tie, TieMismatch

READY = [GradSpec("head.weight", (8, 4), torch.float32, 0), GradSpec("w", (4, 4), torch.float32, 1)]


def setup(ties=None, aliases=()):
    ties = {"head.weight": Tie(((0, "emb.weight"), (1, "head.weight")))} if ties is None else ties
    return StageSetup(stage=1, rank=1, where="rank 1", placement="tied_at_flush", grad_group=Group("g", (1,), 0), all_ranks=Group("w", (0, 1), 1),
                      tie_groups={}, ties=ties, aliases=tuple(frozenset(a) for a in aliases))


def test_auto_placement_reduces_in_the_backward_at_pp1_and_splits_at_pp2():
    assert resolve_placement("auto", pp=1, has_ties=False) == "backward"
    assert resolve_placement("auto", pp=2, has_ties=True) == "tied_at_flush"
    assert resolve_placement("flush", pp=2, has_ties=True) == "flush"


def test_placement_backward_with_a_tie_across_stages_is_refused_as_a_deadlock():
    with pytest.raises(ValueError, match="deadlock.*placement='tied_at_flush'"):
        resolve_placement("backward", pp=2, has_ties=True)


def test_a_backward_graph_holding_every_tied_parameter_passes():
    check_backward_graph(setup(), READY, None)
    check_backward_graph(setup(), READY, READY)  # a recompile with the same parameters


def test_a_second_backward_graph_with_other_parameters_is_refused_as_a_graph_break():
    with pytest.raises(RuntimeError, match="graph break.*fullgraph=True"):
        check_backward_graph(setup(), READY, READY[:1])


def test_two_copies_of_one_weight_on_a_stage_are_refused_by_name():
    ready = READY + [GradSpec("blocks.0.emb", (8, 4), torch.float32, 2)]
    with pytest.raises(TieMismatch, match=r"\['blocks.0.emb', 'head.weight'\]"):
        check_backward_graph(setup(aliases=[["head.weight", "blocks.0.emb"]]), ready, None)


def test_a_tied_parameter_without_a_gradient_is_refused():
    with pytest.raises(TieMismatch, match="head.weight.*no gradient"):
        check_backward_graph(setup(), READY[1:], None)
