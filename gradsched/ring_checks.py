"""What the context-parallel ring can run: each refusal says what was wrong and what to do,
before any collective (the lowering pass calls it at compile time, the ring at run time)."""
from __future__ import annotations

from gradsched.passes.context_parallel import RingAttentionError  # one error for the pass and the ring

ACCUMULATE_MODES = ("fp32", "input", "fp32_blocks")
COMM_MODES = ("ring", "allgather", "a2a", "hybrid", "auto")


def unsupported(call: str, reason: str, fix: str) -> RingAttentionError:
    return RingAttentionError(f"{call}: {reason}. {fix}")


def check_attention_call(call: str, *, q_heads: int, kv_heads: int, local_len: int, cp: int,
                         causal: bool, load_balance: bool = True, dropout_p: float = 0.0,
                         has_attn_mask: bool = False, accumulate: str = "fp32",
                         comm: str = "ring", fewest_roundings: bool = False,
                         device_type: str = "cpu", a2a_degree: int | None = None, masked: bool = False,
                         needs_lse: bool = False, compiled: bool = False,
                         head_dims: tuple | None = None):
    """Raise RingAttentionError if the ring cannot run this attention call.

    `call` names the call in the message (e.g. "scaled_dot_product_attention 'sdpa_2'
    at model.py:41"); `head_dims`: its (query, key, value) head sizes, where known. Shared by the
    runtime op and the lowering pass, which calls it at compile time. Returns the scheme that runs it (gradsched.cp_comm.CommChoice: `comm` and
    `a2a_degree` resolved, 'auto' chosen from the heads, cp and whether the call is `masked`).
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
    if a2a_degree is not None and comm != "hybrid":
        raise unsupported(call, f"a2a_degree={a2a_degree} is set, and comm={comm!r} does not use it",
                          "Set comm='hybrid' (all-to-all over a2a_degree ranks, ring over the rest), or leave "
                          "a2a_degree unset.")
    from gradsched.cp_comm import resolve_comm
    choice = resolve_comm(comm, a2a_degree, call=call, q_heads=q_heads, kv_heads=kv_heads, cp=cp, masked=masked,
                          needs_lse=needs_lse, causal=causal)
    ring_cp = cp if choice.comm == "ring" else cp // choice.a2a if choice.comm == "hybrid" else 1
    if compiled and causal and not load_balance and ring_cp > 1:
        # Functional collectives are pure ops to AOTAutograd: it drops (or moves between forward and
        # backward) those whose results a rank's graph does not use, and in the plain layout the rank
        # holding the first chunk uses no other rank's K/V. Seen: dp2 x cp2 hanging under the default compile.
        raise unsupported(call, "causal attention in the plain layout (load_balance=False) gives the ring's "
                          "ranks unequal work, and compiled, a rank that needs nothing from a ring step loses "
                          "that step's collective from its graph while the others wait for it (a hang)",
                          "Use load_balance=True (the default, head-tail layout), or comm='allgather' or "
                          "comm='a2a', which every rank uses whole.")
    if head_dims is not None and choice.comm != "a2a" and len(set(head_dims)) > 1:
        d_q, d_k, d_v = head_dims
        raise unsupported(call, f"its query, key and value heads have sizes {d_q}, {d_k} and {d_v}, and the ring's "
                          "block kernels (the CPU flash op, flash attention) take one head size for all three",
                          "Use comm='a2a' (the unchanged attention over the whole sequence, for cp-th of the "
                          f"heads), or pad the value heads to {d_q}.")
    if choice.comm == "hybrid" and load_balance and local_len % 2:
        raise unsupported(call, f"comm='hybrid' with the load-balanced layout needs an even local length, and "
                          f"it is {local_len}", f"Pad the sequence to a multiple of {2 * cp}, or use "
                          "load_balance=False.")
    if fewest_roundings and device_type != "cpu":
        # Its joined calls need a mask tensor, which on CUDA only the memory-efficient kernel
        # takes: measured on an H100 (torch 2.11) at 27% of the limit, and with wrong dq/dk
        # in bf16/fp16 causal against fp64 (tests/test_gpu.py caught it).
        raise unsupported(call, f"fewest_roundings=True is for the CPU kernel, and the tensors "
                           f"are on {device_type!r}", "Leave fewest_roundings off: on CUDA the "
                           "flash kernel sums each call in fp32, and the default schedule meets "
                           "the numerics targets.")
    return choice


def check_masked_call(call: str, *, comm: str, cp: int, local_len: int, load_balance: bool) -> None:
    """What a call with a window, documents or padding needs beyond check_attention_call."""
    if comm == "allgather":
        raise unsupported(call, "comm='allgather' does not take a window, documents or padding",
                          "Use comm='ring' (steps with nothing to compute are skipped) or comm='a2a'.")
    if comm != "a2a" and load_balance and cp > 1 and local_len % 2:
        raise unsupported(call, f"the sequence length {local_len * cp} is not divisible by 2*cp={2 * cp} "
                          "(load-balanced layout)", f"Pad the sequence to a multiple of {2 * cp} "
                          "(gradsched.cp_layout.pad_to_multiple, with key_padding False on the pads).")
