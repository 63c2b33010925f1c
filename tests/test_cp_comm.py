"""Which scheme runs a context-parallel attention call (gradsched.cp.comm): comm='auto' and the
refusals of explicit choices the head counts cannot run."""
import pytest

from gradsched.cp.comm import choose_comm, resolve_comm
from gradsched.options import SyncOptions
from gradsched.cp.ring_attention import RingAttentionError, check_attention_call


def auto(q, kv, cp, masked=False, causal=True):
    return choose_comm(q_heads=q, kv_heads=kv, cp=cp, masked=masked, causal=causal)


@pytest.mark.parametrize("kv", (4, 12))
def test_auto_runs_heads_that_split_over_cp_as_a2a(kv):
    choice = auto(12, kv, 4)
    assert (choice.comm, choice.a2a) == ("a2a", 4)
    assert "one unchanged kernel call" in choice.why


def test_auto_keeps_masked_calls_on_the_ring_which_skips_what_nobody_sees():
    choice = auto(12, 12, 4, masked=True)
    assert choice.comm == "ring" and "skips" in choice.why


def test_auto_runs_a_masked_call_without_causality_by_its_heads():
    # padding or documents on bidirectional attention: the ring has no causal blocks to skip either
    assert (auto(12, 12, 4, masked=True, causal=False).comm, auto(12, 12, 4, masked=True, causal=False).a2a) == \
        ("a2a", 4)


def test_auto_prefers_a_hybrid_that_splits_gqa_groups_to_an_a2a_that_repeats_them():
    choice = auto(8, 2, 4)  # a2a over 4 would repeat each key/value head twice; over 2 it splits them
    assert (choice.comm, choice.a2a) == ("hybrid", 2)


def test_auto_repeats_a_single_key_value_head_rather_than_running_the_ring():
    choice = auto(8, 1, 4)
    assert (choice.comm, choice.a2a) == ("a2a", 4) and "repeated" in choice.why


def test_auto_falls_back_to_the_ring_when_no_degree_splits_the_heads():
    choice = auto(3, 3, 4)
    assert choice.comm == "ring" and "no all-to-all degree" in choice.why


def test_hybrid_takes_the_largest_inner_degree_the_heads_allow():
    choice = resolve_comm("hybrid", None, call="c", q_heads=8, kv_heads=8, cp=8, masked=False)
    assert (choice.comm, choice.a2a) == ("hybrid", 4)


def test_hybrid_without_an_inner_degree_is_refused_naming_the_alternatives():
    with pytest.raises(RingAttentionError, match=r"comm='hybrid' at cp=2.*comm='ring'.*comm='a2a'"):
        resolve_comm("hybrid", None, call="c", q_heads=8, kv_heads=8, cp=2, masked=False)


def test_a_degree_that_does_not_divide_cp_is_refused():
    with pytest.raises(RingAttentionError, match=r"a2a_degree=3 does not divide cp=4"):
        resolve_comm("hybrid", 3, call="c", q_heads=12, kv_heads=12, cp=4, masked=False)


def test_a_degree_the_heads_cannot_split_is_refused_naming_the_degrees_that_would():
    with pytest.raises(RingAttentionError, match=r"6 query heads over a2a_degree=4.*degrees that would: \[2\]"):
        resolve_comm("hybrid", 4, call="c", q_heads=6, kv_heads=6, cp=8, masked=False)


def test_a2a_degree_without_hybrid_is_refused_by_the_options_and_the_check():
    with pytest.raises(ValueError, match="a2a_degree=2 is for comm='hybrid'"):
        SyncOptions(comm="ring", a2a_degree=2)
    with pytest.raises(RingAttentionError, match="a2a_degree=2 is set, and comm='a2a' does not use it"):
        check_attention_call("c", q_heads=4, kv_heads=4, local_len=8, cp=4, causal=True, comm="a2a", a2a_degree=2)


def test_auto_never_gives_a2a_to_a_call_that_returns_its_log_sum_exp():
    assert choose_comm(q_heads=12, kv_heads=12, cp=4, masked=False, needs_lse=True).comm == "hybrid"
    assert choose_comm(q_heads=12, kv_heads=12, cp=2, masked=False, needs_lse=True).comm == "ring"
