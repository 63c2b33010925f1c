"""Which collective scheme runs a context-parallel attention call (ring, a2a (Ulysses) or hybrid), and
what each scheme refuses: every refusal says what was wrong and what to do, before any collective
(the lowering pass calls `check_attention_call` at compile time, the ring at run time).

`resolve_comm` turns the option (`comm`, `a2a_degree`) and the call's shape into a CommChoice:
the scheme, its all-to-all degree (1: ring only; cp: all-to-all only) and why. An explicit choice
the head counts cannot run is refused, naming the sizes and what would run. `comm="auto"` picks
by these rules, in order:

1. A causal mask (a window, documents, padding) -> ring. The ring skips the blocks causality empties
   and the steps a window leaves empty; the all-to-all's one call over the whole sequence with a
   mask tensor cannot take the kernel's causal path, and computes (and reads) the whole square.
   A mask on non-causal attention costs both schemes the whole square: the rules below decide. (A
   window no shorter than the sequence is no mask: the lowering drops it first.)
2. Heads that split over all cp ranks without repeating a key/value head -> a2a: the unchanged
   kernel over the whole sequence (no blocks to merge), and for moderate cp fewer bytes than the
   ring (q, k, v and out cross once; the ring passes K/V cp - 1 times and dK/dV in fp32).
3. Else the largest all-to-all degree a < cp that splits the heads without repeating -> hybrid:
   a-th of the ring's steps, and the all-to-all stays among neighbouring ranks.
4. Else a degree that needs key/value heads repeated (GQA with fewer groups than ranks) -> a2a or
   hybrid with it, repeating being cheaper than the ring's cp - 1 passes;
5. Else -> ring (any head count).
A call that returns its log-sum-exp never gets a2a (its unchanged call gives none): hybrid or ring.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradsched.options import ACCUMULATE as ACCUMULATE_MODES
from gradsched.options import COMMS as COMM_MODES
from gradsched.passes.context_parallel import RingAttentionError  # one error for the pass and the ring



def unsupported(call: str, reason: str, fix: str) -> RingAttentionError:
    return RingAttentionError(f"{call}: {reason}. {fix}")


@dataclass(frozen=True)
class CommChoice:
    comm: str  # "ring" | "allgather" | "a2a" | "hybrid"
    a2a: int  # all-to-all degree: 1 for the ring, cp for a2a
    why: str

    def describe(self) -> str:
        scheme = f"hybrid (a2a over {self.a2a} x ring)" if self.comm == "hybrid" else self.comm
        return f"{scheme}: {self.why}"


def heads_allow(q_heads: int, kv_heads: int, a: int) -> bool:
    """Can an all-to-all of degree a give every rank whole query heads and whole GQA groups?"""
    return q_heads % a == 0 and (kv_heads % a == 0 or a % kv_heads == 0)


def _degrees(q_heads: int, kv_heads: int, cp: int) -> list[int]:
    """All-to-all degrees > 1 that divide cp and that the heads allow, largest first."""
    return [a for a in range(cp, 1, -1) if cp % a == 0 and heads_allow(q_heads, kv_heads, a)]


def choose_comm(*, q_heads: int, kv_heads: int, cp: int, masked: bool, needs_lse: bool = False,
                causal: bool = True) -> CommChoice:
    """comm='auto' (the rules in the module docstring). needs_lse: the call returns its log-sum-exp,
    which a2a's unchanged call does not give (hybrid's ring does)."""
    if cp == 1:
        return CommChoice("ring", 1, "cp=1: nothing to communicate")
    if masked and causal:
        return CommChoice("ring", 1, "a causal mask: the ring skips the blocks (and a window's steps) nobody "
                          "sees, an all-to-all's masked call would compute the whole square")
    degrees = [a for a in _degrees(q_heads, kv_heads, cp) if not (needs_lse and a == cp)]
    whole = [a for a in degrees if kv_heads % a == 0]
    for pool, note in ((whole, ""), (degrees, f", each of the {kv_heads} key/value heads repeated")):
        if pool:
            a = pool[0]
            if a == cp:
                return CommChoice("a2a", cp, f"{q_heads} query / {kv_heads} key-value heads split over cp={cp}"
                                  f"{note}: one unchanged kernel call, q/k/v/out cross once")
            return CommChoice("hybrid", a, f"heads split over {a} of cp={cp} ranks at most{note}: all-to-all "
                              f"over {a}, ring over {cp // a}")
    return CommChoice("ring", 1, f"no all-to-all degree dividing cp={cp} splits {q_heads} query / "
                      f"{kv_heads} key-value heads")


def resolve_comm(comm: str, a2a_degree: int | None, *, call: str, q_heads: int, kv_heads: int, cp: int,
                 masked: bool, needs_lse: bool = False, causal: bool = True) -> CommChoice:
    """The scheme a call runs with; raises RingAttentionError for one its heads cannot run."""
    if comm == "auto":
        return choose_comm(q_heads=q_heads, kv_heads=kv_heads, cp=cp, masked=masked, needs_lse=needs_lse,
                           causal=causal)
    if comm in ("ring", "allgather"):
        return CommChoice(comm, 1, "asked for")
    if comm == "a2a":
        _check_degree(call, "comm='a2a'", f"cp={cp}", q_heads, kv_heads, cp, cp)
        return CommChoice("a2a", cp, "asked for")
    # hybrid
    if a2a_degree is None:
        _check_cp_for_hybrid(call, cp)
        inner = [a for a in _degrees(q_heads, kv_heads, cp) if a < cp]
        if not inner:
            raise unsupported(call, f"comm='hybrid' at cp={cp} needs an all-to-all degree a with 1 < a < {cp} "
                              f"dividing {cp} that splits {q_heads} query and {kv_heads} key/value heads, and "
                              "there is none", "Use comm='ring' (any head count), comm='a2a' if the heads "
                              "split over all of cp, or comm='auto'.")
        return CommChoice("hybrid", inner[0], f"asked for; a2a_degree {inner[0]}: the largest the heads allow")
    if a2a_degree < 1 or cp % a2a_degree:
        raise unsupported(call, f"a2a_degree={a2a_degree} does not divide cp={cp}",
                          f"Choose a divisor of {cp} (the all-to-all group size; the ring runs over the rest).")
    _check_degree(call, "comm='hybrid'", f"a2a_degree={a2a_degree}", q_heads, kv_heads, cp, a2a_degree)
    return CommChoice("hybrid", a2a_degree, "asked for")


def _check_cp_for_hybrid(call: str, cp: int) -> None:
    """Hybrid is an all-to-all over a ranks times a ring over cp / a groups, both of more than one rank: it
    needs a divisor a of cp with 1 < a < cp, which a prime cp (2, 3, 5, ...) does not have, whatever the heads."""
    if not any(cp % a == 0 for a in range(2, cp)):
        raise unsupported(call, f"comm='hybrid' at cp={cp} runs an all-to-all over a2a_degree ranks and a ring over "
                          f"cp / a2a_degree groups, so it needs an a2a_degree strictly between 1 and cp that divides "
                          f"cp, and cp={cp} has none (hybrid needs a cp such as 4, 6, 8 or 9)",
                          f"Use comm='ring' (any head count) or comm='a2a' (all-to-all over all {cp} ranks, if the "
                          "heads split over them), or comm='auto' to let each call pick.")


def _check_degree(call: str, what: str, size: str, q_heads: int, kv_heads: int, cp: int, a: int) -> None:
    others = [d for d in _degrees(q_heads, kv_heads, cp) if d != a]
    alt = (f"all-to-all degrees that would: {others} (comm='hybrid', a2a_degree=...)" if others else
           "no all-to-all degree would")
    if q_heads % a:
        raise unsupported(call, f"{what} splits the {q_heads} query heads over {size} ranks, and {q_heads} is not "
                          f"divisible by {a}", f"Use comm='ring' (any head count) or comm='auto'; {alt}.")
    if kv_heads % a and a % kv_heads:
        raise unsupported(call, f"{what} needs the {kv_heads} key/value heads divisible by {size}, or dividing "
                          "it (then each is repeated to the ranks whose queries read it)",
                          f"Use comm='ring' or comm='auto'; {alt}.")


def check_attention_call(call: str, *, q_heads: int, kv_heads: int, local_len: int, cp: int,
                         causal: bool, load_balance: bool = True, dropout_p: float = 0.0,
                         has_attn_mask: bool = False, accumulate: str = "fp32",
                         comm: str = "ring", fewest_roundings: bool = False,
                         device_type: str = "cpu", a2a_degree: int | None = None, masked: bool = False,
                         needs_lse: bool = False,
                         head_dims: tuple | None = None):
    """Raise RingAttentionError if the ring cannot run this attention call.

    `call` names the call in the message (e.g. "scaled_dot_product_attention 'sdpa_2'
    at model.py:41"); `head_dims`: its (query, key, value) head sizes, where known. Shared by the
    runtime op and the lowering pass, which calls it at compile time. Returns the scheme that runs it (gradsched.cp.comm.CommChoice: `comm` and
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
                           f"multiple of {2 * cp} (gradsched.cp.layout.pad_to_multiple), or "
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
    choice = resolve_comm(comm, a2a_degree, call=call, q_heads=q_heads, kv_heads=kv_heads, cp=cp, masked=masked,
                          needs_lse=needs_lse, causal=causal)
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
                          "(gradsched.cp.layout.pad_to_multiple, with key_padding False on the pads).")
