"""The distributed optimizer: fp32 master shards on their owners, parameters gathered in their own dtype,
parameter groups by name, elementwise optimizers only."""
from gradsched.launch import run_ranks

from rank_fns import bf16_parameters_gathered_in_bf16, decay_free_step, non_elementwise_optimizer


def test_bf16_parameters_are_all_gathered_in_bf16_from_their_fp32_master_shards():
    for r in run_ranks(bf16_parameters_gathered_in_bf16, 2):
        assert r["gathers"] and all(g == ("torch.bfloat16", "torch.bfloat16") for g in r["gathers"])
        assert r["exact"]


def test_the_parameter_all_gather_is_in_flight_when_step_returns_and_lands_when_asked():
    # off the critical path: step() issues it; the next forward (here finish_param_gather) waits and writes
    for r in run_ranks(bf16_parameters_gathered_in_bf16, 2):
        assert r["in_flight"] and r["exact"]


def test_decay_free_parameters_are_exactly_untouched_by_weight_decay_and_matrices_exactly_decayed():
    checked = 0
    for params in run_ranks(decay_free_step, 4):
        for name, (before, after) in params.items():
            want = before * 0.5 if before.dim() >= 2 else before  # exact: halving is exact in fp32
            assert after.equal(want), name
            checked += before.dim() == 1
    assert checked  # biases and norm weights were among them


def test_an_optimizer_that_is_not_elementwise_is_refused_on_shards():
    [message] = run_ranks(non_elementwise_optimizer, 1)
    assert message.startswith("TypeError: Adafactor is not an elementwise optimizer") and "shard=False" in message


def test_gradients_count_as_inside_the_buckets_only_when_each_is_a_view_of_one_in_its_dtype():
    """GradSync.reduced_storage scales the buckets in place of the gradients only where that scales every one."""
    import torch

    from gradsched.sync.owners import all_inside
    one, two = torch.zeros(10), torch.zeros(6)
    views = [one[:4], one[4:10].view(2, 3), two[2:5]]
    assert all_inside(views, [two, one])
    assert not all_inside(views + [one[:4].clone()], [one, two])  # a copy: scaling the bucket misses it
    assert not all_inside([one.view(torch.int32)[:2]], [one])  # another dtype over the same memory
    assert not all_inside([torch.zeros(20)[8:12]], [one])  # elsewhere
    assert not all_inside([one[::2]], [one])  # strided: refused (a bucket hands out contiguous slices)
