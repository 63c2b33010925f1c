"""The simulated pipeline step (gradsched.training.schedule_simulation) against the schedules' closed forms, and
the split chosen by it for several stages a rank (gradsched.training.stage_balance)."""
import itertools

import pytest

from gradsched.training.schedule_simulation import simulate_step
from gradsched.training.stage_balance import choose_stages
from gradsched.training.virtual_stages import stage_ranks


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_1f1b_and_gpipe_take_m_plus_pp_minus_one_forwards_and_backwards(schedule, pp, m):
    # equal stages, F = 1 and a backward of B + W = 3: (m + pp - 1)(F + B + W), the textbook bubble
    step = simulate_step(schedule, pp, 1, m, [1.0] * pp, [2.0] * pp, [1.0] * pp)
    assert step.step_s == (m + pp - 1) * 4.0
    assert step.bubble == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 12), (4, 8)])
def test_zb1p_leaves_a_third_of_1f1bs_bubble_when_f_b_and_w_are_equal(pp, m):
    # ZB-H1's paper: (pp - 1)(F + B - W) idle, against 1F1B's (pp - 1)(F + B + W)
    assert simulate_step("zb1p", pp, 1, m, [1.0] * pp, [1.0] * pp, [1.0] * pp).step_s == 3 * m + pp - 1


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8)])
def test_zbv_is_nearly_bubble_free_when_f_b_and_w_are_equal(pp, m):
    # ZB-V's paper: about zero when F = B = W (each of a rank's two stages half its layers)
    v = simulate_step("zbv", pp, 2, m, [0.5] * 2 * pp, [0.5] * 2 * pp, [0.5] * 2 * pp)
    one = simulate_step("1f1b", pp, 1, m, [1.0] * pp, [1.0] * pp, [1.0] * pp)
    assert v.bubble <= one.bubble / 3 and v.step_s < one.step_s


def test_an_activation_crossing_ranks_arrives_p2p_later():
    # 1F1B at pp 2 on one micro-batch: F0, send, F1 and B1, send, B0
    step = simulate_step("1f1b", 2, 1, 1, [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], p2p_s=0.25)
    assert step.step_s == 4.5


def _step(f, b, w, schedule, m):
    def step(cut):
        bounds = (0, *cut, len(f))
        per_stage = [[sum(x[a:z]) for a, z in zip(bounds, bounds[1:])] for x in (f, b, w)]
        return simulate_step(schedule, 2, 2, m, *per_stage).step_s
    return step


def test_under_a_v_the_cut_is_the_shortest_simulated_step_not_the_least_busy_rank():
    # nine pieces of unequal F, B and W: the busiest rank's sum picks 3 | 5 | 8, whose step is 60.5; the V's own
    # order finishes 2 | 3 | 6 in 56, the least any cut gives
    f = [1.5, 0.5, 1.0, 0.5, 1.5, 1.0, 1.0, 1.5, 1.0]
    b = [0.5, 1.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0]
    w = [1.5, 0.5, 1.0, 1.0, 0.5, 1.0, 1.5, 0.5, 1.0]
    step, ranks, total = _step(f, b, w, "zbv", 4), stage_ranks(2, 2, "v"), [x + y + z for x, y, z in zip(f, b, w)]
    by_load, simulated = choose_stages(total, ranks), choose_stages(total, ranks, step)
    assert (by_load, step(by_load)) == ([3, 5, 8], 60.5)
    assert step(simulated) == min(step(c) for c in itertools.combinations(range(1, 9), 3)) == 56.0
