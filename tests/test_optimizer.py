"""The distributed optimizer: fp32 master shards on their owners, parameters gathered in their own dtype."""
from gradsched.launch import run_ranks

from rank_fns import bf16_parameters_gathered_in_bf16


def test_bf16_parameters_are_all_gathered_in_bf16_from_their_fp32_master_shards():
    for r in run_ranks(bf16_parameters_gathered_in_bf16, 2):
        assert r["gathers"] and all(g == ("torch.bfloat16", "torch.bfloat16") for g in r["gathers"])
        assert r["exact"]
