"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank of the CP group holds a slice of the sequence (q, k, v: [B, H, L_local, D]).
The keys and values travel around the group; each rank attends its queries to every
slice in turn and folds the block results together through their log-sum-exp (LSE),
which gives attention over the whole sequence. The backward pass runs its own ring:
K/V travel again (only the local q, k, v, out and LSE are saved, so saved memory does
not grow with cp), and the K/V gradients travel with them back to their owner.

Layout (gradsched.cp_layout makes it): with causal attention and load_balance=True
the sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r, so every
rank does the same work. At ring step i rank r holds the K/V of rank s = (r - i) mod cp;
the block it computes follows from the chunk positions (see `_Ring.visible`):

    s == r   the local causal square: is_causal=True with equal q and k lengths
    s <  r   all local rows x the early K/V chunk of s, fully visible
    s >  r   the late local rows x all K/V of s, fully visible

Without load balancing (rank r holds chunk r of cp) the steps with s > r compute
nothing, but their collectives still run: every rank issues the same collectives in
the same order, whatever it computes.

Kernel calls (gradsched.attention_kernels runs them): the blocks above are cut per local
row chunk. Blocks that are fully masked are never computed, and every diagonal block is a
square the kernel computes with its own causal path (is_causal), so a rank computes what
its rows see and nothing else. The fully visible blocks of a window of ring steps share
one call (forward: step 0 alone, so that it computes while the next K/V travel, then
FORWARD_WINDOW = 3 steps, whose K/V a rank keeps until the window ends; backward: 2
steps). With a reduced input dtype a kernel rounds each call's result (block out; block
dq) to that dtype, so fewer, larger calls are also fewer roundings. `fewest_roundings`
goes one further: a row chunk whose whole attention lies in one window gets ONE call
(causal aligned to the bottom right, as a mask tensor), as accurate as the kernel over
the whole sequence but slower, as the kernels compute a masked block densely. In
backward the dK/dV of the K/V held at step t travel on at step t+1 (one step behind the
K/V), so that a window can finish them. Saved for backward: only the local q, k, v, out
and LSE; transient: up to 3 visiting K/V.

Numerics (`accumulate`):
    "fp32"         blocks run in the input dtype; outs merge in fp32, dq/dk/dv sum in
                   fp32 (dk/dv travel in fp32); one cast to the input dtype at the end.
    "input"        merge and sum in the input dtype (TransformerEngine's default).
    "fp32_blocks"  as "fp32", and each block runs with fp32 operands and outputs, so
                   nothing is rounded before the final cast.

Everything in forward and backward is aten ops and `_c10d_functional` collectives, so
the ring traces under torch.compile(fullgraph=True) and under AOTAutograd.

`simulate_ring` runs the same blocks, merges and sums in the same order for all cp
ranks inside one process (no process group): for numerics and kernel timing. Its
results equal the real ring's bit for bit with comm="ring".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsched.attention_kernels import attend, attend_backward, dq_tile

ACCUMULATE_MODES = ("fp32", "input", "fp32_blocks")
COMM_MODES = ("ring", "allgather")
_c10d = torch.ops._c10d_functional


class RingAttentionError(ValueError):
    """An attention call that the context-parallel ring cannot run as asked."""


def _unsupported(call: str, reason: str, fix: str) -> RingAttentionError:
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
        raise _unsupported(call, "it passes an attn_mask tensor, and the ring computes only causal "
                           "or full attention", "Use is_causal=True instead of a causal mask "
                           "tensor, or keep this attention call out of context parallelism.")
    if dropout_p:
        raise _unsupported(call, f"dropout_p={dropout_p}: attention dropout is not supported by "
                           "the ring", "Set the model's attention dropout to 0.0 for "
                           "context-parallel training.")
    if kv_heads < 1 or q_heads % kv_heads:
        raise _unsupported(call, f"{q_heads} query heads are not a multiple of {kv_heads} key/value "
                           "heads", "Use a head count that GQA allows (query heads = groups x "
                           "key/value heads).")
    if causal and load_balance and local_len % 2:
        raise _unsupported(call, f"the sequence length {local_len * cp} is not divisible by "
                           f"2*cp={2 * cp} (load-balanced causal layout)", "Pad the sequence to a "
                           f"multiple of {2 * cp} (gradsched.cp_layout.pad_to_multiple), or "
                           "use load_balance=False.")
    if accumulate not in ACCUMULATE_MODES:
        raise _unsupported(call, f"accumulate={accumulate!r} is unknown",
                           f"Choose one of {ACCUMULATE_MODES}.")
    if comm not in COMM_MODES:
        raise _unsupported(call, f"comm={comm!r} is unknown", f"Choose one of {COMM_MODES}.")
    if fewest_roundings and device_type != "cpu":
        # Its joined calls need a mask tensor, which on CUDA only the memory-efficient kernel
        # takes: measured on an H100 (torch 2.11) at 27% of the limit, and with wrong dq/dk
        # in bf16/fp16 causal against fp64 (tests/test_gpu.py caught it).
        raise _unsupported(call, f"fewest_roundings=True is for the CPU kernel, and the tensors "
                           f"are on {device_type!r}", "Leave fewest_roundings off: on CUDA the "
                           "flash kernel sums each call in fp32, and the default schedule meets "
                           "the numerics targets.")


# ---- the schedule: which block a rank computes at each ring step ----------------------

FORWARD_WINDOW = 3
"""Ring steps whose K/V a forward kernel call may cover (per local row chunk)."""
BACKWARD_WINDOW = 2
"""Ring steps a backward call may cover: at most 2, as dK/dV travel one step behind K/V."""


@dataclass(frozen=True)
class _Ring:
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
        return dtype if self.accumulate == "input" else torch.float32

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
class _Piece:
    """One visible K/V chunk of one ring step."""
    step: int
    k: torch.Tensor  # the step's whole visiting K (and V), [B, Hkv, L, D]
    v: torch.Tensor
    index: int       # which of its `parts` chunks
    pos: int         # its position in the sequence (orders keys; the diagonal is last)
    diag: bool


def _pieces(ring: _Ring, qid: int, window) -> list[list[_Piece]]:
    """Per step of `window` ([(step, src, k, v)]), the pieces row chunk `qid` sees."""
    return [[_Piece(step, k, v, j, kid, diag) for j, kid, diag in ring.visible(qid, src)]
            for step, src, k, v in window]


# ---- block kernels ----------------------------------------------------------------------

def _expand_heads(x, q_heads: int):
    """K/V with kv heads -> q heads (head j of q reads kv head j // groups), for the kernel."""
    b, h, n, d = x.shape
    if h == q_heads:
        return x
    return x[:, :, None].expand(b, h, q_heads // h, n, d).reshape(b, q_heads, n, d)


def _reduce_heads(g, kv_heads: int, dtype: torch.dtype):
    """Gradient over q heads -> over kv heads, summed in `dtype`."""
    b, h, n, d = g.shape
    g = g.to(dtype)
    if h == kv_heads:
        return g
    return g.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def merge_block(out, lse, block_out, block_lse, dtype: torch.dtype):
    """Fold one block's normalised attention into a running result (None: the first block).

    Both are softmax-normalised over their own keys; weighting each by exp(its LSE -
    the joint LSE) gives attention over the union of keys. `out` is kept in `dtype`,
    LSE in float32. The same function serves the ring and the simulation.
    """
    block_out = block_out.to(dtype)
    if out is None:
        return block_out, block_lse
    joint = torch.logaddexp(lse, block_lse)
    w_run = torch.exp(lse - joint).unsqueeze(-1).to(dtype)
    w_blk = torch.exp(block_lse - joint).unsqueeze(-1).to(dtype)
    return out * w_run + block_out * w_blk, joint


def _operands(ring: _Ring, *xs):
    if ring.accumulate == "fp32_blocks":
        return tuple(x.float() for x in xs)
    return xs


def _keys(pieces: list[_Piece], ring: _Ring, rows: int, dtype: torch.dtype):
    """One kernel call's K, V (pieces in sequence order), is_causal and attn_mask.

    Only the rows' own (diagonal) chunk is causal, and it comes last: with as many
    keys as rows the block is a causal square; with more, causal aligned to the bottom
    right (the CPU kernel's is_causal is top-left aligned), given as a mask.
    """
    ks = [p.k.chunk(ring.parts, dim=2)[p.index] for p in pieces]
    vs = [p.v.chunk(ring.parts, dim=2)[p.index] for p in pieces]
    k, v = (ks[0], vs[0]) if len(pieces) == 1 else (torch.cat(ks, 2), torch.cat(vs, 2))
    k, v = _operands(ring, k, v)
    n = k.shape[2]
    if not pieces[-1].diag:
        return k, v, False, None
    if n == rows:  # a causal square (one diagonal chunk, or the local square)
        return k, v, True, None
    hidden = torch.ones(rows, n, dtype=torch.bool, device=k.device).triu(n - rows + 1)
    mask = torch.zeros(rows, n, dtype=dtype, device=k.device).masked_fill(hidden, float("-inf"))
    return k, v, False, mask


def _by_pos(pieces: list[_Piece]) -> list[_Piece]:
    """Pieces in sequence order. (A plain insertion sort: Dynamo refuses sorted() with a
    key read off these objects in some traces.)"""
    out: list[_Piece] = []
    for p in pieces:
        i = len(out)
        while i and out[i - 1].pos > p.pos:
            i -= 1
        out.insert(i, p)
    return out


def _calls(ring: _Ring, qid: int, window, rounded: bool, limit: int | None = None):
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
    blocks = _pieces(ring, qid, window)
    pieces = [p for block in blocks for p in block]
    if not pieces:
        return []
    chunk = pieces[0].k.shape[2] // ring.parts
    fits = limit is None or len(pieces) * chunk <= limit
    if ring.fewest_roundings and rounded and fits and len(pieces) == ring.seen(qid):
        return [_by_pos(pieces)]
    calls = [[p] for p in pieces if p.diag]
    current = []
    for block in blocks:
        block = [p for p in block if not p.diag]
        if not block:
            continue
        if current and limit is not None and (len(current) + len(block)) * chunk > limit:
            calls.append(_by_pos(current))
            current = []
        current = current + block
    if current:
        calls.append(_by_pos(current))
    return calls


def _rounded(dtype: torch.dtype) -> bool:
    """Does a kernel in `dtype` round its results to less than fp32?"""
    return torch.finfo(dtype).bits < 32


def _plan(ring: _Ring, window, rounded: bool, limit: int | None = None):
    """Every kernel call of the window: [(local row chunks, pieces)].

    The calls of each row chunk (`_calls`), except that where both row chunks of the
    balanced layout would make the same call, they make it together (one kernel call
    over twice the rows runs faster, much so in bf16 backward); and their two causal
    diagonal calls become one: the local causal square (all local rows x the local K/V,
    is_causal), taking the late rows' fully visible local early chunk with it.
    """
    per_row = [_calls(ring, qid, window, rounded, limit) for qid in ring.chunks(ring.rank)]
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


def _forward_window(state: list, q, rows: list, window, ring: _Ring) -> None:
    """Attend the local rows to what they see of the window's K/V (see `_plan`), merging
    into `state` ([out, lse] per row chunk) in place. q: all local rows; rows: its chunks."""
    heads = q.shape[1]
    dtype = ring.acc_dtype(q.dtype)
    (q,) = _operands(ring, q)
    rows = _operands(ring, *rows)
    for parts, pieces in _plan(ring, window, _rounded(q.dtype)):
        x = rows[parts[0]] if len(parts) == 1 else q
        k, v, causal, mask = _keys(pieces, ring, x.shape[2], x.dtype)
        out, lse = attend(x, _expand_heads(k, heads), _expand_heads(v, heads), causal,
                           ring.scale, mask)
        outs = (out,) if len(parts) == 1 else out.chunk(len(parts), dim=2)
        lses = (lse,) if len(parts) == 1 else lse.chunk(len(parts), dim=2)
        for p, o, l in zip(parts, outs, lses):
            state[p][0], state[p][1] = merge_block(state[p][0], state[p][1], o, l, dtype)


def _row_chunks(x, parts: int) -> list:
    return [c.contiguous() for c in x.chunk(parts, dim=2)] if parts > 1 else [x]


def _finish_forward(state: list, dtype: torch.dtype, ring: _Ring):
    """(out in the input dtype, LSE fp32, the out to save for backward)."""
    out = torch.cat([s[0] for s in state], dim=2) if len(state) > 1 else state[0][0]
    lse = torch.cat([s[1] for s in state], dim=2) if len(state) > 1 else state[0][1]
    final = out.to(dtype)
    return final, lse, (out if ring.accumulate == "fp32_blocks" else final)


def _rows_for_backward(ring: _Ring, q, out, dout, lse) -> list[tuple]:
    """(q, out, dout, lse) of all local rows, then of each local row chunk; operands in
    the block dtype."""
    q, out, dout = _operands(ring, q, out, dout)
    dout = dout.contiguous()
    return [(q, out, dout, lse)] + list(zip(*(_row_chunks(x, ring.parts)
                                              for x in (q, out, dout, lse))))


def _backward_window(dq: list, rows: list, window, grads: dict, ring: _Ring, kshape, vshape):
    """Gradients of every call of the window (see `_plan`): dq added into `dq` (per row
    chunk) in place, dk/dv into `grads[step]` (a flat [dk | dv] for the step's K/V, created
    here). rows: `_rows_for_backward`."""
    heads = rows[0][0].shape[1]
    dtype = dq[0].dtype
    x = rows[0][0]
    for parts, pieces in _plan(ring, window, _rounded(x.dtype), dq_tile(x.device.type, x.dtype)):
        q, out, dout, lse = rows[1 + parts[0]] if len(parts) == 1 else rows[0]
        k, v, causal, mask = _keys(pieces, ring, q.shape[2], q.dtype)
        gq, gk, gv = attend_backward(dout, q, _expand_heads(k, heads), _expand_heads(v, heads),
                                      out, lse, causal, ring.scale, mask)
        for p, g in zip(parts, (gq,) if len(parts) == 1 else gq.chunk(len(parts), dim=2)):
            dq[p] += g
        gk = _reduce_heads(gk, kshape[1], dtype).split(kshape[2] // ring.parts, dim=2)
        gv = _reduce_heads(gv, vshape[1], dtype).split(vshape[2] // ring.parts, dim=2)
        for piece, dk, dv in zip(pieces, gk, gv):
            if piece.step not in grads:
                grads[piece.step] = torch.zeros(math.prod(kshape) + math.prod(vshape),
                                                dtype=dtype, device=q.device)
            gk_all, gv_all = _unflat(grads[piece.step], kshape, vshape)
            gk_all.chunk(ring.parts, dim=2)[piece.index].add_(dk)
            gv_all.chunk(ring.parts, dim=2)[piece.index].add_(dv)


def _window_ends(cp: int, size: int) -> set[int]:
    """Steps after which a window of `size` steps is computed (the last step ends one)."""
    return {s for s in range(cp) if s % size == size - 1 or s == cp - 1}


def _forward_ends(ring: _Ring) -> set[int]:
    """Forward windows: step 0 (the local K/V) alone, so that it computes while the next
    K/V travel, then FORWARD_WINDOW steps each. With fewest_roundings, windows of
    FORWARD_WINDOW from step 0, so that at cp <= FORWARD_WINDOW one window holds the
    whole ring and a row's attention can be one call."""
    if ring.fewest_roundings:
        return _window_ends(ring.cp, FORWARD_WINDOW)
    return {0} | {s + 1 for s in _window_ends(ring.cp - 1, FORWARD_WINDOW)}


def _flat(k, v):
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unflat(kv, kshape, vshape):
    nk = math.prod(kshape)
    return kv[:nk].view(kshape), kv[nk:].view(vshape)


# ---- collectives ----------------------------------------------------------------------

def _send_to_next(flat, ring: _Ring):
    """Every rank sends `flat` to rank+1 and receives rank-1's (one all_to_all_single)."""
    n = flat.numel()
    recv = [0] * ring.cp
    send = [0] * ring.cp
    recv[(ring.rank - 1) % ring.cp] = n
    send[(ring.rank + 1) % ring.cp] = n
    return _c10d.all_to_all_single(flat, recv, send, ring.group_name)


def _wait(t):
    return _c10d.wait_tensor(t)


def _all_gather(flat, ring: _Ring):
    out = _wait(_c10d.all_gather_into_tensor(flat, ring.cp, ring.group_name))
    return out.view(ring.cp, -1)


# ---- the ring on one rank -------------------------------------------------------------

def _ring_forward(q, k, v, ring: _Ring):
    rows = _row_chunks(q, ring.parts)
    state = [[None, None] for _ in range(ring.parts)]
    kv = _flat(k, v)
    gathered = _all_gather(kv, ring) if ring.comm == "allgather" and ring.cp > 1 else None
    ends = _forward_ends(ring)
    pending, window = None, []
    for step in range(ring.cp):
        src = (ring.rank - step) % ring.cp
        if gathered is not None:
            kv = gathered[src]
        else:
            if step > 0:
                kv = _wait(pending)
            if step < ring.cp - 1:
                pending = _send_to_next(kv, ring)  # in flight while this step computes
        window.append((step, src, *_unflat(kv, k.shape, v.shape)))
        if step in ends:
            _forward_window(state, q, rows, window, ring)
            window = []
    return _finish_forward(state, q.dtype, ring)


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring):
    """The backward ring. K/V travel as in forward; a window of BACKWARD_WINDOW (2) steps
    is computed at its end, so the dK/dV of the K/V held at step t are complete one step
    later: every rank sends them on at step t+1 (rank r+1 holds that K/V at step t+1 and
    completes its share at step t+2). Same collectives, in the same order, on every rank.
    """
    rows = _rows_for_backward(ring, q, out, dout, lse)
    dtype = ring.acc_dtype(q.dtype)
    dq = [torch.zeros(r[0].shape, dtype=dtype, device=q.device) for r in rows[1:]]
    kv = _flat(k, v)
    allgather = ring.comm == "allgather" and ring.cp > 1
    if allgather:
        gathered = _all_gather(kv, ring)
        dkv_all = torch.zeros((ring.cp, kv.numel()), dtype=dtype, device=q.device)
    ends = _window_ends(ring.cp, BACKWARD_WINDOW)
    pending_kv = pending_dkv = None
    grads, window = {}, []
    for step in range(ring.cp + 1):
        if step < ring.cp:
            src = (ring.rank - step) % ring.cp
            if allgather:
                kv = gathered[src]
            else:
                if step > 0:
                    kv = _wait(pending_kv)
                if step < ring.cp - 1:
                    pending_kv = _send_to_next(kv, ring)
            window.append((step, src, *_unflat(kv, k.shape, v.shape)))
            if step in ends:
                _backward_window(dq, rows, window, grads, ring, k.shape, v.shape)
                window = []
        if step == 0 or ring.cp == 1:
            continue
        done, mine = step - 1, grads.pop(step - 1, None)  # the K/V held at step - 1
        if allgather:
            if mine is not None:
                dkv_all[(ring.rank - done) % ring.cp] += mine
            continue
        if done == 0:  # our own K/V: its dK/dV starts here
            dkv = mine if mine is not None else \
                torch.zeros(kv.numel(), dtype=dtype, device=q.device)
        else:  # as summed by the ranks before this one
            dkv = _wait(pending_dkv)
            if mine is not None:
                dkv.add_(mine)
        pending_dkv = _send_to_next(dkv, ring)
    if allgather:
        dkv = _wait(_c10d.reduce_scatter_tensor(dkv_all.view(-1), "sum", ring.cp, ring.group_name))
    elif ring.cp > 1:
        dkv = _wait(pending_dkv)  # our own K/V's gradient, back from the last rank
    else:
        dkv = grads.pop(0, None)
        if dkv is None:
            dkv = torch.zeros(kv.numel(), dtype=dtype, device=q.device)
    dk, dv = _unflat(dkv, k.shape, v.shape)
    dq = torch.cat(dq, dim=2) if len(dq) > 1 else dq[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group_name, rank, cp, causal, scale, accumulate, comm, load_balance,
                fewest_roundings):
        ring = _Ring(rank, cp, causal, load_balance, scale, accumulate, group_name, comm,
                     fewest_roundings)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, saved_out = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, saved_out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.ring)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


@torch.compiler.assume_constant_result
def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, size) of this process in a group given by name or ProcessGroup.

    Constant for a process, so torch.compile runs it once while tracing.
    """
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def ring_attention(q, k, v, group_name: str, *, causal: bool = False, scale: float | None = None,
                   accumulate: str = "fp32", comm: str = "ring", load_balance: bool = True,
                   return_lse: bool = False, call: str = "ring_attention",
                   fewest_roundings: bool = False):
    """Attention of local q over the K/V of every rank of the CP group `group_name`.

    q: [B, Hq, L, D], k/v: [B, Hkv, L, D] with Hq a multiple of Hkv; each rank holds its
    slice of the sequence in the layout of gradsched.cp_layout (same `load_balance`).
    Returns out [B, Hq, L, Dv] (and the LSE, float32 [B, Hq, L], if return_lse). `call`
    names the caller's attention call in errors. fewest_roundings: join a row's whole
    attention into one kernel call where a window holds it (cp <= 3), with a bottom-right
    causal mask tensor, for one rounding fewer in a reduced dtype; the kernels compute masked
    blocks densely, so it is slower (see benchmarks/cp_speed.py --fewest-roundings).
    """
    rank, cp = group_rank_and_size(group_name)
    check_attention_call(call, q_heads=q.shape[1], kv_heads=k.shape[1], local_len=q.shape[2],
                         cp=cp, causal=causal, load_balance=load_balance, accumulate=accumulate,
                         comm=comm, fewest_roundings=fewest_roundings, device_type=q.device.type)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = _RingAttention.apply(q, k, v, group_name, rank, cp, causal, float(scale),
                                    accumulate, comm, load_balance, bool(fewest_roundings))
    return (out, lse) if return_lse else out


# ---- the same ring, every rank in turn, in one process ----------------------------------

def _rank_forward(ring: _Ring, q, ks, vs):
    """Rank ring.rank's forward with every rank's K/V at hand (ks, vs: per rank):
    (out, LSE, out to save), as _ring_forward computes them."""
    rows = _row_chunks(q, ring.parts)
    state = [[None, None] for _ in range(ring.parts)]
    for window in _windows(ring, _forward_ends(ring), ks, vs):
        _forward_window(state, q, rows, window, ring)
    return _finish_forward(state, q.dtype, ring)


def _rank_backward(ring: _Ring, q, ks, vs, dout, lse, saved_out):
    """Rank ring.rank's backward with every K/V at hand: (dq in the accumulation dtype,
    {step: flat dK/dV of the K/V held at that step})."""
    rows = _rows_for_backward(ring, q, saved_out, dout, lse)
    dtype = ring.acc_dtype(q.dtype)
    dq = [torch.zeros(x[0].shape, dtype=dtype, device=q.device) for x in rows[1:]]
    grads = {}
    for window in _windows(ring, _window_ends(ring.cp, BACKWARD_WINDOW), ks, vs):
        _backward_window(dq, rows, window, grads, ring, ks[0].shape, vs[0].shape)
    return (torch.cat(dq, dim=2) if len(dq) > 1 else dq[0]), grads


def rank_compute(q, k, v, dout, cp: int, rank: int, causal: bool = False,
                 accumulate: str = "fp32", *, load_balance: bool = True,
                 fewest_roundings: bool = False):
    """A function running one rank's share of the ring's compute (forward and backward
    blocks, merges and sums, no communication): to time the schedule against the limit,
    one full-sequence kernel's time / cp. Inputs as simulate_ring's, on any device."""
    from gradsched.cp_layout import shard

    check_attention_call("rank_compute", q_heads=q.shape[1], kv_heads=k.shape[1],
                         local_len=q.shape[2] // cp, cp=cp, causal=causal,
                         load_balance=load_balance, accumulate=accumulate,
                         fewest_roundings=fewest_roundings, device_type=q.device.type)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ks, vs = ([shard(x, cp, r, dim=2, load_balance=load_balance).contiguous() for r in range(cp)]
              for x in (k, v))
    ql, dl = (shard(x, cp, rank, dim=2, load_balance=load_balance).contiguous() for x in (q, dout))

    def run():  # the ring is made inside, as in _RingAttention.forward, so that Dynamo traces it
        ring = _Ring(rank, cp, causal, load_balance, scale, accumulate,
                     fewest_roundings=fewest_roundings)
        out, lse, saved = _rank_forward(ring, ql, ks, vs)
        return _rank_backward(ring, ql, ks, vs, dl, lse, saved)
    return run


@dataclass
class SimResult:
    """Full-sequence results in natural token order (grads None without grad_out)."""
    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None


def _windows(ring: _Ring, ends: set[int], ks, vs):
    """The ring's windows on one rank, each ending at a step of `ends`: lists of
    (step, src, k, v)."""
    window = []
    for step in range(ring.cp):
        src = (ring.rank - step) % ring.cp
        window.append((step, src, ks[src], vs[src]))
        if step in ends:
            yield window
            window = []


def simulate_ring(q, k, v, cp: int, causal: bool = False, accumulate: str = "fp32", *,
                  scale: float | None = None, load_balance: bool = True,
                  grad_out: torch.Tensor | None = None,
                  fewest_roundings: bool = False) -> SimResult:
    """Run the cp-rank ring on one device: same blocks, merges and sums, in the same order.

    q, k, v (and grad_out) cover the whole sequence in natural order ([B, H, S, D]); they
    are cut into the cp_layout shards, every rank's steps run in turn, and the results
    are put back in natural order.
    """
    from gradsched.cp_layout import shard, unshard

    check_attention_call("simulate_ring", q_heads=q.shape[1], kv_heads=k.shape[1],
                         local_len=q.shape[2] // cp, cp=cp, causal=causal,
                         load_balance=load_balance, accumulate=accumulate,
                         fewest_roundings=fewest_roundings, device_type=q.device.type)
    if q.shape[2] % cp:
        raise _unsupported("simulate_ring", f"the sequence length {q.shape[2]} is not divisible "
                           f"by cp={cp}", "Pad the sequence.")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    rings = [_Ring(r, cp, causal, load_balance, float(scale), accumulate,
                   fewest_roundings=fewest_roundings) for r in range(cp)]

    def cut(x):
        return [shard(x, cp, r, dim=2, load_balance=load_balance).contiguous() for r in range(cp)]

    qs, ks, vs = cut(q), cut(k), cut(v)
    finished = [_rank_forward(ring, qs[r], ks, vs) for r, ring in enumerate(rings)]
    result = SimResult(unshard([f[0] for f in finished], cp, dim=2, load_balance=load_balance),
                       unshard([f[1] for f in finished], cp, dim=2, load_balance=load_balance))
    if grad_out is None:
        return result

    douts = cut(grad_out)
    dtype = rings[0].acc_dtype(q.dtype)
    kshape, vshape = ks[0].shape, vs[0].shape
    # grads[r][step]: rank r's dK/dV for the K/V it holds at step
    dqs, grads = zip(*(_rank_backward(ring, qs[r], ks, vs, douts[r], *finished[r][1:])
                       for r, ring in enumerate(rings)))
    dkvs = []
    for src in range(cp):  # summed in ring order, starting at the owner, as the ring does
        dkv = None
        for step in range(cp):
            mine = grads[(src + step) % cp].get(step)
            if mine is not None:
                dkv = mine if dkv is None else dkv.add_(mine)
        dkvs.append(dkv if dkv is not None else
                    torch.zeros(ks[0].numel() + vs[0].numel(), dtype=dtype, device=q.device))
    dks, dvs = zip(*(_unflat(d, kshape, vshape) for d in dkvs))
    result.dq = unshard([d.to(q.dtype) for d in dqs], cp, dim=2, load_balance=load_balance)
    result.dk = unshard([d.to(k.dtype) for d in dks], cp, dim=2, load_balance=load_balance)
    result.dv = unshard([d.to(v.dtype) for d in dvs], cp, dim=2, load_balance=load_balance)
    return result
