"""Every comparison helper reports a NaN or an inf as a failure (an infinite difference), never as agreement.

Python's max(0.0, nan) is 0.0 and inf - inf is NaN, so a max over differences once read a model full of NaN
as equal to its reference. One process, inputs fabricated in the shapes the multi-rank tests pass: the
poisoned tensor comes after a finite one, where max(0.0, nan) hid it."""
import math
import sys
from pathlib import Path

import pytest
import torch

from test_ring_attention import check_accuracy, errors
from tied_training import abs_diff, compare, gradient_error, max_state_diff

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cp_numerics  # noqa: E402
import memory  # noqa: E402

BAD = [float("nan"), float("inf"), float("-inf")]
IDS = ["nan", "inf", "-inf"]


def tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"wte.weight": torch.randn(8, 4, generator=g), "blocks.0.attn.weight": torch.randn(4, 4, generator=g),
            "ln_f.bias": torch.randn(4, generator=g)}


def poisoned(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[-1] = value
    return t


def copy(d: dict, poison: str | None = None, value: float = 0.0) -> dict:
    return {n: poisoned(t, value) if n == poison else t.clone() for n, t in d.items()}


# ---- examples/tied_training.py --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_abs_diff_is_infinite_for_a_nan_or_inf_on_either_side_even_the_same_one(value):
    a = torch.zeros(5)
    assert abs_diff(poisoned(a, value), a) == math.inf
    assert abs_diff(a, poisoned(a, value)) == math.inf
    assert abs_diff(poisoned(a, value), poisoned(a, value)) == math.inf  # not a bitwise check
    assert abs_diff(a, a) == 0.0 and abs_diff(a, a + 0.5) == 0.5


def ranks_of(params: dict, n: int = 2) -> list[dict]:
    """compare()'s input: each rank's trained parameters (here dp ranks, each the whole model)."""
    return [{"rank": i, "stage": 0, "dp_idx": i, "cp_idx": 0, "params": copy(params), "ties": []} for i in range(n)]


@pytest.mark.parametrize("side", ["parallel", "reference"])
@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_compare_reports_a_nan_or_inf_parameter_as_an_infinite_difference(value, side):
    params = tensors()
    ref = {"params": copy(params), "aliases": []}
    ranks = ranks_of(params)
    assert compare(ref, ranks)["max_abs_diff"] == 0.0  # equal finite parameters agree
    if side == "parallel":
        ranks[1]["params"]["ln_f.bias"] = poisoned(params["ln_f.bias"], value)  # the last rank's last tensor
    else:
        ref["params"]["ln_f.bias"] = poisoned(params["ln_f.bias"], value)
    cmp = compare(ref, ranks)
    assert cmp["max_abs_diff"] == math.inf
    assert not cmp["max_abs_diff"] < 1e-5  # what the tests assert fails


def test_compare_still_measures_a_finite_difference():
    params = tensors()
    ranks = ranks_of(params)
    ranks[1]["params"]["blocks.0.attn.weight"][0, 0] += 0.25
    assert compare({"params": params, "aliases": []}, ranks)["max_abs_diff"] == pytest.approx(0.25)


def full_grads(grads: dict) -> list[dict]:
    """gradient_error()'s input for shard=False: every rank's .grad of every parameter."""
    return [{"grads": {"full": copy(grads)}} for _ in range(2)]


def sharded_grads(grads: dict, poison: tuple | None = None) -> list[dict]:
    """gradient_error()'s input for shard=True: each of 2 ranks' reduced half of one bucket holding every
    gradient in order; poison=(rank, value) sets that rank's last element."""
    slots, offset = [], 0
    for name, g in grads.items():
        slots.append((name, offset, g.numel()))
        offset += g.numel()
    numel = offset + offset % 2  # padded to a multiple of the ranks
    flat = torch.zeros(numel)
    flat[:offset] = torch.cat([g.reshape(-1) for g in grads.values()])
    ranks = [{"grads": {"shards": [flat[i * numel // 2:(i + 1) * numel // 2].clone()], "shard_index": i,
                        "shards_n": 2, "buckets": [(numel, slots)]}} for i in range(2)]
    if poison:
        ranks[poison[0]]["grads"]["shards"][0] = poisoned(ranks[poison[0]]["grads"]["shards"][0], poison[1])
    return ranks


@pytest.mark.parametrize("layout", ["full", "shards"])
@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_gradient_error_reports_a_nan_or_inf_gradient_on_either_side(value, layout):
    grads = tensors()
    ref = {"grads": copy(grads)}
    same = full_grads(grads) if layout == "full" else sharded_grads(grads)
    assert gradient_error(ref, same) == 0.0
    bad_rank = full_grads(grads) if layout == "full" else sharded_grads(grads, poison=(1, value))
    if layout == "full":
        bad_rank[1]["grads"]["full"]["ln_f.bias"] = poisoned(grads["ln_f.bias"], value)
    assert gradient_error(ref, bad_rank) == math.inf
    # the reference's own NaN or inf, where it would drop out of the scale (and inf / inf is NaN)
    assert gradient_error({"grads": copy(grads, "ln_f.bias", value)}, same) == math.inf


def test_gradient_error_still_measures_a_finite_difference():
    grads = tensors()
    ranks = full_grads(grads)
    ranks[0]["grads"]["full"]["wte.weight"][1, 1] += 0.5
    scale = max(g.abs().max().item() for g in grads.values())
    assert gradient_error({"grads": grads}, ranks) == pytest.approx(0.5 / scale)


def checkpoint(values: dict) -> dict:
    """What checkpoint_contents() reads back: model/, optim/ (master weights and moments) and other keys."""
    out = {f"model/{n}": t for n, t in values.items()}
    out.update({f"optim/state/{n}/exp_avg": t * 0.1 for n, t in values.items()})
    out["optim/state/ln_f.bias/step"] = torch.tensor(3.0)
    out["data_position"] = torch.tensor(float("nan"))  # outside the prefixes compared: not looked at
    return out


@pytest.mark.parametrize("key", ["model/ln_f.bias", "optim/state/wte.weight/exp_avg"])
@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_max_state_diff_reports_a_nan_or_inf_in_either_checkpoint(value, key):
    a, b = checkpoint(tensors()), checkpoint(tensors())
    assert max_state_diff(a, b) == 0.0
    bad = dict(b, **{key: poisoned(b[key], value)})
    assert max_state_diff(a, bad) == math.inf and max_state_diff(bad, a) == math.inf
    assert max_state_diff(bad, dict(bad)) == math.inf  # both the same NaN: still a failure, not 0


# ---- tests/test_ring_attention.py -----------------------------------------------------------------------------

def attention_like(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(4))


@pytest.mark.parametrize("where", ["ring", "single", "reference"])
@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_ring_attention_check_accuracy_fails_a_nan_or_inf(value, where):
    ref = attention_like(0)
    got, single = tuple(r.float() for r in ref), tuple(r.float() for r in ref)
    assert check_accuracy(got, single, ref, torch.float32, 2) == []
    got, single, ref = ([poisoned(t, value) if i == 3 else t for i, t in enumerate(x)] if where == name else x
                        for name, x in (("ring", got), ("single", single), ("reference", ref)))
    failures = check_accuracy(got, single, ref, torch.float32, 2)
    assert len(failures) == 1 and failures[0].startswith("dv: not finite"), failures
    assert errors(poisoned(ref[0], value), ref[0]) == (math.inf, math.inf)


# ---- tests/test_triton_attention.py (the interpreter's kernel tests) ------------------------------------------

@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_triton_attentions_mean_error_is_infinite_for_a_nan_or_inf(value):
    pytest.importorskip("triton")
    from test_triton_attention import mean_err
    r = torch.linspace(-1, 1, 16, dtype=torch.float64)
    assert mean_err(r.float(), r) < 1e-7
    assert mean_err(poisoned(r, value).float(), r) == math.inf and mean_err(r.float(), poisoned(r, value)) == math.inf


# ---- benchmarks/memory.py and benchmarks/cp_numerics.py -------------------------------------------------------

@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_memory_benchmarks_parameter_diff_reports_a_nan_or_inf(value):
    params = tensors()
    runs = [copy(params), copy(params)]
    assert memory.max_abs_diff(runs, params) == 0.0
    runs[1] = copy(params, "ln_f.bias", value)
    assert memory.max_abs_diff(runs, params) == math.inf
    assert memory.max_abs_diff([copy(params)], copy(params, "ln_f.bias", value)) == math.inf


@pytest.mark.parametrize("where", ["ring", "single"])
@pytest.mark.parametrize("value", BAD, ids=IDS)
def test_cp_numerics_metrics_report_a_nan_or_inf_as_infinite_error(value, where):
    ref = attention_like(1)[0]
    x = ref.float()
    row = cp_numerics.metrics(x, x, ref)
    assert row["max_abs_err"] < 1e-6 and math.isfinite(row["ratio_to_single"])
    row = cp_numerics.metrics(poisoned(x, value) if where == "ring" else x,
                              poisoned(x, value) if where == "single" else x, ref)
    assert row["ratio_to_single"] == math.inf  # a NaN or inf in the baseline must not make the ring look good
    if where == "ring":
        assert row["max_abs_err"] == row["mean_abs_err"] == math.inf
    else:
        assert row["single_mean_abs_err"] == math.inf
