"""The ring's schedule: which kernel calls a rank makes at each ring step.

Layout (gradsched.cp.layout makes it): with causal attention and load_balance=True
the sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r, so every
rank does the same work. At ring step i rank r holds the K/V of rank s = (r - i) mod cp;
what each local row chunk sees of it is `Ring.visible`:

    s == r   the local causal square: is_causal=True with equal q and k lengths
    s <  r   all local rows x the early K/V chunk of s, fully visible
    s >  r   the late local rows x all K/V of s, fully visible

Fully masked blocks are never computed; every diagonal block is a square the kernel
computes with its own causal path; the fully visible blocks of a window of ring steps
share one call (`row_calls`, `plan_calls`). Pure bookkeeping over chunk indices: no
kernel runs here, so tests/test_ring_schedule.py can count what a rank computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORWARD_WINDOW = 3
"""Ring steps whose K/V a forward kernel call may cover (per local row chunk)."""
BACKWARD_WINDOW = 2
"""Ring steps a backward call may cover: at most 2, as dK/dV travel one step behind K/V."""


def fast_roundings(cp: int) -> int:
    """Most kernel calls one row's forward output spans in the fast schedule (`forward_ends`):
    step 0 (the local square), then one per window of FORWARD_WINDOW steps. In a reduced dtype
    each is one more rounding of the row's output."""
    return 1 + -(-(cp - 1) // FORWARD_WINDOW)


def fewest_roundings_default(device_type: str, cp: int, masked: bool = False) -> bool:
    """fewest_roundings=None: on for the CPU kernel where the fast schedule would round a row's
    bf16/fp16 output more than twice (cp > FORWARD_WINDOW + 1), and for every masked call there;
    off elsewhere (the CUDA kernels' masked path is refused, see comm.check_attention_call).

    Measured with benchmarks/cp_numerics.py at TransformerEngine #821's shapes (S 4096, 12 heads,
    dim 128, bf16, causal), fast schedule against fewest_roundings, out / dq ratio to a single
    device's error (targets 1.15x / 0.95x): cp 8, 1.17 / 0.955 against 1.13 / 0.94 (the fast one
    misses); cp 4, 1.14 / 0.955 against 1.09 / 0.954; cp 2, 1.11 / 0.998 against 1.00 / 0.997 (the
    same gradients, out within target), and there the fast one runs at 0.93 of the limit against
    0.88 (benchmarks/cp_speed.py). The masked ring's targets (fp32: no worse than the single device)
    were met with it on."""
    if device_type != "cpu":
        return False
    return masked or fast_roundings(cp) > 2


def acc_dtype(accumulate: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype block results merge and sum in: the input's with accumulate="input", else fp32 or wider (a
    float64 model keeps float64: rounding it to fp32 would make the ring less exact than one process)."""
    return dtype if accumulate == "input" else torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class Ring:
    """One ring's settings, as the per-step helpers need them."""
    rank: int
    cp: int
    causal: bool
    load_balance: bool
    scale: float
    accumulate: str
    group_name: str = ""
    comm: str = "ring"
    fewest_roundings: bool = False

    @property
    def parts(self) -> int:  # local rows are kept as this many chunks
        return 2 if self.causal and self.load_balance and self.cp > 1 else 1

    def acc_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return acc_dtype(self.accumulate, dtype)

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Sequence positions (chunk indices) of rank's local chunks, in local order."""
        return (rank, 2 * self.cp - 1 - rank) if self.parts == 2 else (rank,)

    def visible(self, qid: int, src: int) -> list[tuple[int, int, bool]]:
        """What local row chunk `qid` sees of src's K/V: [(chunk index in the K/V, its
        position, diagonal)]: under causal attention only the chunks before it, and its own
        as a diagonal block."""
        seen = []
        for j, kid in enumerate(self.chunks(src)):
            if not self.causal or kid < qid:
                seen.append((j, kid, False))
            elif kid == qid:
                seen.append((j, kid, True))
        return seen

    def seen(self, qid: int) -> int:
        """How many K/V chunks row chunk `qid` sees over the whole ring."""
        return sum(len(self.visible(qid, src)) for src in range(self.cp))


@dataclass(frozen=True)
class Piece:
    """One visible K/V chunk of one ring step."""
    step: int
    k: torch.Tensor  # the step's whole visiting K (and V), [B, Hkv, L, D]
    v: torch.Tensor
    index: int       # which of its `parts` chunks
    pos: int         # its position in the sequence (orders keys; the diagonal is last)
    diag: bool


def visible_pieces(ring: Ring, qid: int, window) -> list[list[Piece]]:
    """Per step of `window` ([(step, src, k, v)]), the pieces row chunk `qid` sees."""
    return [[Piece(step, k, v, j, kid, diag) for j, kid, diag in ring.visible(qid, src)]
            for step, src, k, v in window]



def by_position(pieces: list[Piece]) -> list[Piece]:
    """Pieces in sequence order. (A plain insertion sort: Dynamo refuses sorted() with a
    key read off these objects in some traces.)"""
    out: list[Piece] = []
    for p in pieces:
        i = len(out)
        while i and out[i - 1].pos > p.pos:
            i -= 1
        out.insert(i, p)
    return out


def row_calls(ring: Ring, qid: int, window, rounded: bool, limit: int | None = None):
    """The kernel calls of row chunk `qid` over `window`: lists of pieces, in sequence order.

    The diagonal chunk gets its own causal call (a square: no mask). The fully visible
    chunks of the window share calls of at most `limit` keys (forward: no limit),
    consecutive steps together: each call a row spans costs one more rounding of its
    result (the block out in forward, the block dq in backward) when the kernel runs in
    a reduced dtype (`rounded`). With ring.fewest_roundings, a row chunk whose every
    visible chunk is in the window (and fits `limit`) gets ONE call, with a bottom-right
    causal mask if its diagonal chunk is among them: as accurate as the kernel over the
    whole sequence, slower for the mask.
    """
    blocks = visible_pieces(ring, qid, window)
    pieces = [p for block in blocks for p in block]
    if not pieces:
        return []
    chunk = pieces[0].k.shape[2] // ring.parts
    fits = limit is None or len(pieces) * chunk <= limit
    if ring.fewest_roundings and rounded and fits and len(pieces) == ring.seen(qid):
        return [by_position(pieces)]
    calls = [[p] for p in pieces if p.diag]
    current = []
    for block in blocks:
        block = [p for p in block if not p.diag]
        if not block:
            continue
        if current and limit is not None and (len(current) + len(block)) * chunk > limit:
            calls.append(by_position(current))
            current = []
        current = current + block
    if current:
        calls.append(by_position(current))
    return calls


def rounds_results(dtype: torch.dtype) -> bool:
    """Does a kernel in `dtype` round its results to less than fp32?"""
    return torch.finfo(dtype).bits < 32


def plan_calls(ring: Ring, window, rounded: bool, limit: int | None = None):
    """Every kernel call of the window: [(local row chunks, pieces)].

    The calls of each row chunk (`row_calls`), except that where both row chunks of the
    balanced layout would make the same call, they make it together (one kernel call
    over twice the rows runs faster, much so in bf16 backward); and their two causal
    diagonal calls become one: the local causal square (all local rows x the local K/V,
    is_causal), taking the late rows' fully visible local early chunk with it.
    """
    per_row = [row_calls(ring, qid, window, rounded, limit) for qid in ring.chunks(ring.rank)]
    if ring.parts == 1:
        return [((0,), c) for c in per_row[0]]
    early, late = per_row
    plan = []
    # Calls are picked by index, not identity: older Dynamo (torch 2.11) cannot trace
    # `is` between lists.
    i0 = next((i for i, c in enumerate(early) if len(c) == 1 and c[0].diag), None)
    i1 = next((i for i, c in enumerate(late) if len(c) == 1 and c[0].diag), None)
    own = next(((i, j) for i, c in enumerate(late) for j, p in enumerate(c)
                if p.step == 0 and p.index == 0), None)
    if i0 is not None and i1 is not None and own is not None:
        gi, pj = own
        rest = [p for j, p in enumerate(late[gi]) if j != pj]
        plan.append(((0, 1), [late[gi][pj], late[i1][0]]))
        late = [c for i, c in enumerate(late) if i != i1 and i != gi] + ([rest] if rest else [])
        early = [c for i, c in enumerate(early) if i != i0]
    for c in early:  # the same fully visible keys for both row chunks: one call
        same = [(p.step, p.index) for p in c]
        twin = None if any(p.diag for p in c) else next(
            (i for i, t in enumerate(late)
             if not any(p.diag for p in t) and [(p.step, p.index) for p in t] == same), None)
        if twin is not None:
            late = [t for i, t in enumerate(late) if i != twin]
        plan.append(((0, 1) if twin is not None else (0,), c))
    return plan + [((1,), c) for c in late]


def window_ends(cp: int, size: int) -> set[int]:
    """Steps after which a window of `size` steps is computed (the last step ends one)."""
    return {s for s in range(cp) if s % size == size - 1 or s == cp - 1}


def forward_ends(ring: Ring) -> set[int]:
    """Forward windows: step 0 (the local K/V) alone, so that it computes while the next
    K/V travel, then FORWARD_WINDOW steps each. With fewest_roundings, windows of
    FORWARD_WINDOW from step 0, so that at cp <= FORWARD_WINDOW one window holds the
    whole ring and a row's attention can be one call."""
    if ring.fewest_roundings:
        return window_ends(ring.cp, FORWARD_WINDOW)
    return {0} | {s + 1 for s in window_ends(ring.cp - 1, FORWARD_WINDOW)}
