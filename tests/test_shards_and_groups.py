"""Pieces of parameters in a rank's shard, and parameter groups by name: bookkeeping checked exactly."""
import pytest
import torch

from gradsched.training.param_groups import options_by_name, weight_decay_groups
from gradsched.passes.bucketing import plan_buckets
from gradsched.passes.grad_ready_order import GradSpec
from gradsched.training.shards import owned_pieces

READY = [GradSpec("a", (5, 3), torch.float32, 0), GradSpec("b", (7,), torch.float32, 1),
         GradSpec("c", (4, 4), torch.float32, 2)]


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_the_pieces_of_every_shard_hold_every_element_once_where_the_flat_bucket_has_it(shards):
    layout = plan_buckets(READY, bucket_mb=40 * 4 / 2**20, shards=shards)  # several buckets, padded
    values = {r.name: torch.arange(float(torch.Size(r.shape).numel())) + 100 * i for i, r in enumerate(READY)}
    seen = {n: torch.zeros_like(v) for n, v in values.items()}
    for k in range(shards):
        for b in layout.buckets:  # the flat bucket, as the reduce-scatter cuts it
            flat = torch.zeros(b.numel)
            for s in b.slots:
                flat[s.offset:s.offset + s.numel] = values[s.name]
            size = b.shard_numel(shards)
            mine = flat[k * size:(k + 1) * size]
            for pc in owned_pieces(layout, k):
                if pc.bucket == b.index:
                    assert mine[pc.at:pc.at + pc.numel].equal(values[pc.name][pc.lo:pc.hi])
                    seen[pc.name][pc.lo:pc.hi] += 1
    assert all(s.eq(1).all() for s in seen.values())


PARAMS = {"wte.weight": torch.nn.Parameter(torch.zeros(4, 2)), "ln.weight": torch.nn.Parameter(torch.zeros(2)),
          "ln.bias": torch.nn.Parameter(torch.zeros(2))}
UNSPLIT = list(PARAMS.items()) + [("lm_head.weight", PARAMS["wte.weight"])]
COPIES = {"wte.weight": ["lm_head.weight", "wte.weight"]}


def test_weight_decay_groups_decay_matrices_and_leave_biases_and_norms_free():
    got = options_by_name(weight_decay_groups(0.1), PARAMS, COPIES, UNSPLIT)
    assert got == {"wte.weight": {"weight_decay": 0.1}, "ln.weight": {"weight_decay": 0.0},
                   "ln.bias": {"weight_decay": 0.0}}


def test_torch_style_groups_match_by_name_or_by_parameter_and_the_rest_take_the_defaults():
    got = options_by_name([{"params": ["ln.bias"], "lr": 1.0}, {"params": [PARAMS["ln.weight"]], "lr": 2.0}],
                          PARAMS, COPIES, UNSPLIT)
    assert got == {"wte.weight": {}, "ln.weight": {"lr": 2.0}, "ln.bias": {"lr": 1.0}}


def test_a_group_naming_a_parameter_the_model_lacks_is_refused():
    with pytest.raises(ValueError, match="'ln_f.bias', which is not a parameter"):
        options_by_name([{"params": ["ln_f.bias"], "lr": 1.0}], PARAMS, COPIES, UNSPLIT)


def test_copies_of_one_weight_given_different_options_are_refused():
    def by_name(name, p):
        return {"lr": 1.0} if name == "lm_head.weight" else {}
    with pytest.raises(ValueError, match="different options under its names"):
        options_by_name(by_name, PARAMS, COPIES, UNSPLIT)


def test_a_group_listing_one_name_of_a_tied_weight_covers_its_other_names():
    got = options_by_name([{"params": ["lm_head.weight"], "lr": 3.0}], PARAMS, COPIES, UNSPLIT)
    assert got["wte.weight"] == {"lr": 3.0}
