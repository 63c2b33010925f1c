"""A user's own model for `python -m gradsched.dryrun --module dryrun_factory:tiny_gpt` (tests/test_dryrun.py)."""
from tiny_gpt import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab=96, seq=32, dim=32, heads=4, layers=2)


def tiny_gpt():
    """Built under torch.device("meta") by the dry run; its tied head and the stage boundary are the user's."""
    return TinyGPT(CONFIG), ["blocks.1"]
