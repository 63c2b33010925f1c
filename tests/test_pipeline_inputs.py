"""A pipeline split must hand the first stage its inputs in the model's call order (one process)."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

from gradsched.pipeline_split import check_first_stage_inputs
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
