"""What the context-parallel ring can run: each refusal says what was wrong and what to do,
before any collective (the lowering pass calls it at compile time, the ring at run time)."""
from __future__ import annotations

from gradsched.passes.context_parallel import RingAttentionError  # one error for the pass and the ring

ACCUMULATE_MODES = ("fp32", "input", "fp32_blocks")
COMM_MODES = ("ring", "allgather", "a2a")


def unsupported(call: str, reason: str, fix: str) -> RingAttentionError:
    return RingAttentionError(f"{call}: {reason}. {fix}")


def check_attention_call(call: str, *, q_heads: int, kv_heads: int, local_len: int, cp: int,
                         causal: bool, load_balance: bool = True, dropout_p: float = 0.0,
                         has_attn_mask: bool = False, accumulate: str = "fp32",
                         comm: str = "ring", fewest_roundings: bool = False,
                         device_type: str = "cpu") -> None:
    """Raise RingAttentionError if the ring cannot run this attention call.

    `call` names the call in the message (e.g. "scaled_dot_product_attention 'sdpa_2'
    at model.py:41"). Shared by the runtime op and the lowering pass, which calls it
    at compile time.
    """
    if has_attn_mask:
        raise unsupported(call, "it passes an attn_mask tensor, and the ring computes only causal "
                           "or full attention", "Use is_causal=True instead of a causal mask "
                           "tensor, or keep this attention call out of context parallelism.")
    if dropout_p:
        raise unsupported(call, f"dropout_p={dropout_p}: attention dropout is not supported by "
                           "the ring", "Set the model's attention dropout to 0.0 for "
                           "context-parallel training.")
    if kv_heads < 1 or q_heads % kv_heads:
        raise unsupported(call, f"{q_heads} query heads are not a multiple of {kv_heads} key/value "
                           "heads", "Use a head count that GQA allows (query heads = groups x "
                           "key/value heads).")
    if causal and load_balance and local_len % 2:
        raise unsupported(call, f"the sequence length {local_len * cp} is not divisible by "
                           f"2*cp={2 * cp} (load-balanced causal layout)", "Pad the sequence to a "
                           f"multiple of {2 * cp} (gradsched.cp_layout.pad_to_multiple), or "
                           "use load_balance=False.")
    if accumulate not in ACCUMULATE_MODES:
        raise unsupported(call, f"accumulate={accumulate!r} is unknown",
                           f"Choose one of {ACCUMULATE_MODES}.")
    if comm not in COMM_MODES:
        raise unsupported(call, f"comm={comm!r} is unknown", f"Choose one of {COMM_MODES}.")
    if comm == "a2a":
        _check_heads_for_a2a(call, q_heads, kv_heads, cp)
    if fewest_roundings and device_type != "cpu":
        # Its joined calls need a mask tensor, which on CUDA only the memory-efficient kernel
        # takes: measured on an H100 (torch 2.11) at 27% of the limit, and with wrong dq/dk
        # in bf16/fp16 causal against fp64 (tests/test_gpu.py caught it).
        raise unsupported(call, f"fewest_roundings=True is for the CPU kernel, and the tensors "
                           f"are on {device_type!r}", "Leave fewest_roundings off: on CUDA the "
                           "flash kernel sums each call in fp32, and the default schedule meets "
                           "the numerics targets.")


def check_masked_call(call: str, *, comm: str, cp: int, local_len: int, load_balance: bool) -> None:
    """What a call with a window, documents or padding needs beyond check_attention_call."""
    if comm == "allgather":
        raise unsupported(call, "comm='allgather' does not take a window, documents or padding",
                          "Use comm='ring' (steps with nothing to compute are skipped) or comm='a2a'.")
    if comm != "a2a" and load_balance and cp > 1 and local_len % 2:
        raise unsupported(call, f"the sequence length {local_len * cp} is not divisible by 2*cp={2 * cp} "
                          "(load-balanced layout)", f"Pad the sequence to a multiple of {2 * cp} "
                          "(gradsched.cp_layout.pad_to_multiple, with key_padding False on the pads).")


def _check_heads_for_a2a(call: str, q_heads: int, kv_heads: int, cp: int) -> None:
    """comm='a2a' splits the heads over the CP ranks: every rank must get whole query heads and
    whole GQA groups."""
    if q_heads % cp:
        raise unsupported(call, f"comm='a2a' splits the {q_heads} query heads over cp={cp} ranks, and "
                           f"{q_heads} is not divisible by {cp}", "Use comm='ring' (any head count), or a cp "
                           f"that divides {q_heads}.")
    if kv_heads % cp and cp % kv_heads:
        raise unsupported(call, f"comm='a2a' needs the {kv_heads} key/value heads divisible by cp={cp}, or "
                           "dividing it (then each is repeated to the ranks whose queries read it)",
                           f"Use comm='ring', or a cp that {kv_heads} divides or that divides {kv_heads}.")
