"""A pipeline split must hand the first stage its inputs in the model's call order (one process)."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

from gradsched.training.pipeline_split import check_first_stage_inputs
from gradsched.user_errors import StageError


class TwoInputs(nn.Module):
    def __init__(self, positions_first: bool):
        super().__init__()
        self.positions_first = positions_first
        self.tok, self.pos = nn.Embedding(16, 8), nn.Embedding(16, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, tokens, positions):
        if self.positions_first:
            p = self.pos(positions)
            h = self.tok(tokens) + p
        else:
            h = self.tok(tokens) + self.pos(positions)
        return self.b(self.a(h))


def split(model):
    tokens, positions = torch.randint(0, 16, (2, 4)), torch.arange(4).expand(2, 4)  # distinct: export merges equal ones
    return pipeline(model, mb_args=(tokens, positions), split_spec={"b": SplitPoint.BEGINNING})


def test_inputs_used_in_call_order_are_accepted():
    check_first_stage_inputs(split(TwoInputs(positions_first=False)), "TwoInputs")


def test_inputs_used_out_of_call_order_are_refused_instead_of_swapped():
    with pytest.raises(StageError, match=r"order \['positions', 'tokens'\].*called with \['tokens', 'positions'\]"):
        check_first_stage_inputs(split(TwoInputs(positions_first=True)), "TwoInputs")


def test_values_read_from_several_stages_back_are_passed_on_through_every_stage_between():
    """Stage 3 reads stage 2's output, a value stage 0 computes and stage 1's one output: passing the first on makes
    stage 1's output a tuple, and the second is then passed on from its place in it. The split runs the model."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    from gradsched.training.pipeline_split import check_adjacent_stages, pass_through_skips

    class Skips(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l0, self.l1, self.l2, self.l3 = (torch.nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            h0, e = self.l0(x), torch.tanh(x)
            h1 = self.l1(h0)
            return self.l3(self.l2(h1)) + e * h1

    torch.manual_seed(0)
    model, x = Skips(), torch.randn(2, 4)
    with torch.no_grad():
        pipe = pipeline(model, mb_args=(x,), split_spec={p: SplitPoint.BEGINNING for p in ("l1", "l2", "l3")})
        assert pass_through_skips(pipe) == 3  # e through stages 1 and 2, h1 through stage 2
        check_adjacent_stages(pipe, "Skips")
        assert torch.equal(pipe(x)[0], model(x))


@pytest.mark.parametrize("points", [["tok"], ["b", "tok"]], ids=["the_first_module", "with_a_later_one"])
def test_a_split_point_that_begins_no_stage_is_refused_naming_the_split_points(points):
    # the model's first module leaves stage 0 empty: pipelining made fewer stages, and its own error (a missing
    # submodule, an invalid stage index) named none
    tokens, positions = torch.randint(0, 16, (2, 4)), torch.arange(4).expand(2, 4)
    model = TwoInputs(positions_first=False)
    pipe = pipeline(model, mb_args=(tokens, positions), split_spec={p: SplitPoint.BEGINNING for p in points})
    from gradsched.training.pipeline_split import check_stage_count
    with pytest.raises(StageError, match=r"at \[.*'tok'.*\] made \d stages, not %d" % (len(points) + 1)):
        check_stage_count(pipe, points, "TwoInputs")
    check_stage_count(split(TwoInputs(positions_first=False)), ["b"], "TwoInputs")  # one stage a point: accepted
