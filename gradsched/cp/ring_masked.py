"""The ring with masks: sliding windows, packed documents and padding (see gradsched.cp.attention_masks).

What a block of (local row chunk, visiting K/V chunk) sees follows from two things:
- the layout and the window, known when the graph is built: a block is `empty` (every key
  in the future or past the window), `full`, a causal `square` (the diagonal with a window
  no shorter than the chunk) or `partial`. `MaskedRing.steps` keeps only the ring steps at
  which some rank has a non-empty block: a window shorter than a chunk needs steps 0, 1
  and cp-1 of the load-balanced layout (or 0 and 1 of the plain one), whatever cp is.
- with explicit documents (seq_idx: the document-balanced layout, where a document's tokens are
  spread over the sequence in pieces) the window is measured on positions, not on where chunks
  sit, so it empties no block statically: `window_on_positions` keeps only the causal kinds,
  and the window becomes part of every block's mask.
- the per-token document ids and padding, known only at run time: gathered once over the
  CP group at the start of the forward (a few integers per token), in natural order, and
  applied as a mask to every block they touch. Blocks they empty are computed as masked
  (the graph cannot branch on data), never skipped by guess.

Since steps are skipped, K/V do not hop rank to rank: every rank receives the K/V of rank r-s
for each needed step s straight from it, all in one all_to_all_single, and in backward sends the
dK/dV it computed for them straight back in another. Every rank issues the same collectives in
the same order (the steps are a function of cp, the layout and the window).

Numerics as the ring's (`accumulate`): block outs merge in fp32 through their LSE, dq/dK/dV
sum in fp32; with `fewest_roundings` (the CPU default) a row chunk's blocks of all steps are one
kernel call (backward: calls of at most the kernel's dq tile). A row that sees nothing in a
block has its block LSE set to -inf before the merge (the kernels report 0); a row that sees
nothing at all gets zeros and LSE 0, like the single device's kernel, and zero gradients.
With a window or a per-token mask, accumulate="fp32" runs the CPU kernel on fp32 operands, forward
and backward (`MaskedRing.cast`): a key's dK/dV (window) or a row's dq (documents in pieces) sums
several calls' results, which a reduced-dtype kernel would round before the fp32 sum, and the
forward's calls split keys differently from the single device's one call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsched.cp.attention_kernels import attend, attend_backward, dq_tile, upcast_operands
from gradsched.cp.layout import layout_order, rank_chunks
from gradsched.cp.attention_masks import token_masks, visible
from gradsched.cp.ring_blocks import (add_kv_grads, expand_heads, flat_kv, merge_block, pop_kv_grads, reduce_heads,
                                      unflat_kv, unflat_kv_grads)
from gradsched.cp.keep import Uses, anchored
from gradsched.cp.ring_schedule import acc_dtype, rounds_results

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class MaskedRing:
    """One masked ring's static settings."""
    rank: int
    cp: int
    causal: bool
    load_balance: bool
    scale: float
    accumulate: str
    chunk: int  # tokens per layout chunk
    window: int | None = None
    per_token: bool = False  # document ids or padding: every block gets a mask tensor
    fewest_roundings: bool = False
    group_name: str = ""
    window_on_positions: bool = False  # explicit documents: the window is a per-token mask

    @property
    def chunk_window(self) -> int | None:
        """The window as far as chunk positions tell (None where they do not)."""
        return None if self.window_on_positions else self.window

    def acc_dtype(self, dtype: torch.dtype) -> torch.dtype:  # the ring's rule (ring_schedule.acc_dtype)
        return acc_dtype(self.accumulate, dtype)

    def cast(self, *xs):
        """Kernel operands. accumulate="fp32" with a window or a per-token mask gives a kernel that
        returns its operands' dtype (the CPU aten kernel) fp32 operands, as "fp32_blocks" does: the
        blocks of such a call are split differently from the single device's one call (another tile
        split forward; sums over calls and ranks backward), and rounding each to bf16 lost to the
        single device (out 1.002x, dK 1.21x its error). Masked calls on CUDA run the efficient
        kernel, which takes a mask and returns its operands' dtype: they are upcast too."""
        x, masked = xs[0], self.window is not None or self.per_token
        blocks = self.accumulate == "fp32_blocks" or (masked and self.accumulate == "fp32")
        if blocks and upcast_operands(x.device.type, x.dtype, "fp32_blocks", has_mask=masked):
            return tuple(x.float() for x in xs)
        return xs

    def chunks(self, rank: int) -> tuple[int, ...]:
        return rank_chunks(rank, self.cp, self.load_balance) if self.cp > 1 else (0,)

    def kind(self, qid: int, kid: int) -> str:
        """What row chunk qid sees of key chunk kid, from positions and the window alone."""
        if not self.causal:
            return "full"
        c, w = self.chunk, self.chunk_window
        qa, qb, ka, kb = qid * c, qid * c + c - 1, kid * c, kid * c + c - 1
        if ka > qb or (w is not None and kb <= qa - w):
            return "empty"
        if kb <= qa and (w is None or qb - ka < w):
            return "full"
        if qid == kid and (w is None or c - 1 < w):
            return "square"
        return "partial"

    def pieces(self, rank: int, step: int) -> list[tuple[int, int, int, str]]:
        """Non-empty blocks of `rank` at `step`: (local row part, key part, key chunk, kind)."""
        src = (rank - step) % self.cp
        out = []
        for p, qid in enumerate(self.chunks(rank)):
            for j, kid in enumerate(self.chunks(src)):
                kind = self.kind(qid, kid)
                if kind != "empty":
                    out.append((p, j, kid, kind))
        return out

    def steps(self) -> list[int]:
        """Ring steps at which any rank has something to compute (the same list on every rank)."""
        return [s for s in range(self.cp) if any(self.pieces(r, s) for r in range(self.cp))]

    def groups(self, rounded: bool) -> list[list[int]]:
        """Steps whose blocks share kernel calls: all of them with fewest_roundings in a reduced
        dtype (one call per row chunk: one rounding), else one step each."""
        steps = self.steps()
        return [steps] if self.fewest_roundings and rounded else [[s] for s in steps]


# ---- per-token metadata ------------------------------------------------------------------

def gather_tokens(position_ids, key_padding, cp: int, group_name: str, load_balance: bool, seq_len: int,
                  seq_idx=None):
    """(document ids, key keep mask, positions for the window) over the whole sequence in sequence
    order, [B', S] each (None where not given or not needed: positions only with seq_idx), from each
    rank's slice in cp_layout's order: one all-gather."""
    if position_ids is None and key_padding is None and seq_idx is None:
        return None, None, None
    given = [t for t in (position_ids, key_padding, seq_idx) if t is not None]
    parts = [t.long() for t in given]
    rows = max(t.shape[0] for t in parts)
    local = torch.stack([t.expand(rows, -1) for t in parts])  # [n, B', L]
    if cp == 1:
        full = local
    else:
        got = _c10d.wait_tensor(_c10d.all_gather_into_tensor(local.contiguous(), cp, group_name))
        laid = got.view(cp, *local.shape).permute(1, 2, 0, 3).reshape(local.shape[0], rows, seq_len)
        full = laid.index_select(2, torch.argsort(layout_order(seq_len, cp, load_balance, device=local.device)))
    rows_of = iter(full)  # one row per given tensor, in order
    return natural_tokens(*(next(rows_of) if t is not None else None for t in (position_ids, key_padding, seq_idx)))


def natural_tokens(position_ids, key_padding, seq_idx=None):
    """gather_tokens for one process: the whole sequence is already in sequence order."""
    doc, pos = token_masks(position_ids, seq_idx)
    return doc, (key_padding.bool() if key_padding is not None else None), pos


# ---- one kernel call ---------------------------------------------------------------------

def _call_mask(ring: MaskedRing, qid: int, pieces, tokens, dtype, device):
    """(is_causal, additive mask [B', 1, rows, n] or None, rows that see nothing [B', 1, rows] or
    None) of one call: row chunk qid over `pieces` [(kid, kind)] in order."""
    kinds = [kind for _, kind in pieces]
    if not ring.per_token and all(k == "full" for k in kinds):
        return False, None, None
    if not ring.per_token and kinds == ["square"]:
        return True, None, None
    c = ring.chunk
    q_idx = torch.arange(qid * c, qid * c + c, device=device)
    k_idx = torch.cat([torch.arange(kid * c, kid * c + c, device=device) for kid, _ in pieces])
    doc, keep, pos = tokens
    pick = lambda t, idx: t.index_select(1, idx) if t is not None else None  # noqa: E731
    seen = visible(q_idx, k_idx, causal=ring.causal, window=ring.window, q_doc=pick(doc, q_idx),
                   k_doc=pick(doc, k_idx), k_keep=pick(keep, k_idx), q_pos=pick(pos, q_idx),
                   k_pos=pick(pos, k_idx))[:, None]
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))
    return False, mask, ~seen.any(-1)


def _calls(ring: MaskedRing, rank: int, group: list[int], limit: int | None):
    """Kernel calls of `rank` over a group of steps: (row part, [(step, key part, key chunk,
    kind)]) with keys in sequence order, at most `limit` keys per call."""
    per_row: dict[int, list] = {}
    for step in group:
        for p, j, kid, kind in ring.pieces(rank, step):
            per_row.setdefault(p, []).append((step, j, kid, kind))
    calls = []
    for p in sorted(per_row):
        pieces = sorted(per_row[p], key=lambda x: x[2])
        most = len(pieces) if limit is None else max(1, limit // ring.chunk)
        for i in range(0, len(pieces), most):
            calls.append((p, pieces[i:i + most]))
    return calls


def _keys(pieces, kvs, parts: int):
    """One call's K and V: the pieces' chunks of the visiting K/V, concatenated in order."""
    ks = [kvs[step][0].chunk(parts, dim=2)[j] for step, j, _, _ in pieces]
    vs = [kvs[step][1].chunk(parts, dim=2)[j] for step, j, _, _ in pieces]
    return (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks, 2), torch.cat(vs, 2))


# ---- one rank's forward and backward, whatever moves the K/V ---------------------------------

def rank_forward(ring: MaskedRing, q, kv_at, tokens):
    """(out in q's dtype, LSE fp32, out to save for backward). kv_at(step) -> (k, v) of the K/V
    held at that step (called in step order)."""
    heads, parts = q.shape[1], len(ring.chunks(ring.rank))
    dtype = ring.acc_dtype(q.dtype)
    (qo,) = ring.cast(q)
    rows = qo.chunk(parts, dim=2)
    state = [[None, None] for _ in range(parts)]
    for group in ring.groups(rounds_results(q.dtype)):
        kvs = {s: ring.cast(*kv_at(s)) for s in group}
        for p, pieces in _calls(ring, ring.rank, group, None):
            qid = ring.chunks(ring.rank)[p]
            k, v = _keys(pieces, kvs, parts)
            causal, mask, none = _call_mask(ring, qid, [(kid, kind) for _, _, kid, kind in pieces], tokens,
                                            rows[p].dtype, q.device)
            out, lse = attend(rows[p], expand_heads(k, heads), expand_heads(v, heads), causal, ring.scale, mask,
                              ring.accumulate)
            if none is not None:  # kernels give such rows LSE 0 (CPU) or NaN (some CUDA kernels): neither merges
                lse = lse.masked_fill(none, float("-inf"))
                out = out.masked_fill(none[..., None], 0.0)
            state[p] = list(merge_block(state[p][0], state[p][1], out, lse, dtype, empty_rows=True))
    outs, lses = [], []
    for p, (out, lse) in enumerate(state):
        if out is None:  # nothing visible to this row chunk anywhere
            out = torch.zeros(rows[p].shape[:-1] + (q.shape[-1],), dtype=dtype, device=q.device)
            lse = torch.full(rows[p].shape[:-1], float("-inf"), device=q.device)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=2) if parts > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if parts > 1 else lses[0]
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # nothing seen: 0, as the kernels
    final = out.to(q.dtype)
    return final, lse, (out if ring.accumulate == "fp32_blocks" else final)


def rank_backward(ring: MaskedRing, q, dout, out, lse, kv_at, tokens, kshape, vshape, give_back):
    """dq (accumulation dtype); give_back(step, flat dK/dV) for every step in order."""
    heads, parts = q.shape[1], len(ring.chunks(ring.rank))
    dtype = ring.acc_dtype(q.dtype)
    qo, outo, douto = ring.cast(q, out, dout)
    rows = [x.chunk(parts, dim=2) for x in (qo, outo, douto.contiguous(), lse)]
    dq = [torch.zeros(r.shape, dtype=dtype, device=q.device) for r in rows[0]]
    limit = dq_tile(q.device.type, q.dtype)
    for group in ring.groups(rounds_results(q.dtype)):
        kvs = {s: ring.cast(*kv_at(s)) for s in group}
        grads = {}
        for p, pieces in _calls(ring, ring.rank, group, limit):
            qid = ring.chunks(ring.rank)[p]
            k, v = _keys(pieces, kvs, parts)
            causal, mask, _ = _call_mask(ring, qid, [(kid, kind) for _, _, kid, kind in pieces], tokens,
                                         rows[0][p].dtype, q.device)
            gq, gk, gv = attend_backward(rows[2][p].contiguous(), rows[0][p].contiguous(), expand_heads(k, heads),
                                         expand_heads(v, heads), rows[1][p].contiguous(), rows[3][p].contiguous(),
                                         causal, ring.scale, mask, ring.accumulate)
            dq[p] += gq
            gk = reduce_heads(gk, kshape[1], dtype).split(ring.chunk, dim=2)
            gv = reduce_heads(gv, vshape[1], dtype).split(ring.chunk, dim=2)
            for (step, j, _, _), dk, dv in zip(pieces, gk, gv):
                add_kv_grads(grads, step, j, dk, dv)
        for s in group:
            dkv = pop_kv_grads(grads, s, parts, kshape, dtype, q.device)
            give_back(s, dkv if dkv is not None else
                      torch.zeros(math.prod(kshape) + math.prod(vshape), dtype=dtype, device=q.device))
    return torch.cat(dq, dim=2) if parts > 1 else dq[0]


# ---- the ring: K/V and their gradients straight between ranks ------------------------------
# One all_to_all_single for all visiting K/V and one for all dK/dV going back: collectives that share
# no data could be reordered by the partitioner or Inductor differently on each rank (a hang or a
# size mismatch), while these two are ordered by data (dK/dV need the K/V). The K/V of all steps are
# held at once, as the fewest_roundings schedule (one call over all steps) needs them anyway.

def _all_visits(k, v, ring: MaskedRing, uses: Uses, anchor=None):
    """kv_at for the ring: every rank sends its K/V to rank r+s for each step s > 0 and receives the
    K/V of rank r-s, in one all-to-all (kept in `uses`: a rank may need none of them)."""
    steps = [s for s in ring.steps() if s > 0]
    if not steps:
        return lambda step: (k, v)
    flat, n, cp, r = flat_kv(k, v), k.numel() + v.numel(), ring.cp, ring.rank
    flat = anchored(flat, anchor) if anchor is not None else flat  # the backward's own visits
    send, recv = [0] * cp, [0] * cp
    for s in steps:
        send[(r + s) % cp] = n
        recv[(r - s) % cp] = n
    got = uses.keep(_c10d.wait_tensor(_c10d.all_to_all_single(flat.repeat(len(steps)), recv, send,
                                                               ring.group_name)))
    sources = sorted((r - s) % cp for s in steps)  # the received parts, in source rank order
    parts = {s: got[sources.index((r - s) % cp) * n:][:n] for s in steps}
    return lambda step: (k, v) if step == 0 else unflat_kv(parts[step], k.shape, v.shape)


def _ring_forward(q, k, v, tokens, ring):
    uses = Uses()
    out, lse, saved = rank_forward(ring, q, _all_visits(k, v, ring, uses), tokens)
    return uses.tie(out), lse, saved


def _ring_backward(dout, q, k, v, out, lse, tokens, ring):
    dtype = ring.acc_dtype(q.dtype)
    own = torch.zeros(k.numel() + v.numel(), dtype=dtype, device=q.device)
    grads = {}

    def give_back(step, dkv):
        if step == 0:
            own.add_(dkv)
        else:
            grads[step] = dkv

    uses = Uses()
    dq = rank_backward(ring, q, dout, out, lse, _all_visits(k, v, ring, uses, dout), tokens, k.shape, v.shape,
                       give_back)
    if grads:  # to each K/V's owner, rank r - s; ours come from ranks r + s
        cp, r, n = ring.cp, ring.rank, own.numel()
        by_dest = sorted(grads, key=lambda s: (r - s) % cp)
        send, recv = [0] * cp, [0] * cp
        for s in grads:
            send[(r - s) % cp] = n
            recv[(r + s) % cp] = n
        sent = anchored(torch.cat([grads[s] for s in by_dest]), dout)  # a backward collective on every rank
        got = _c10d.wait_tensor(_c10d.all_to_all_single(sent, recv, send, ring.group_name))
        sources = sorted((r + s) % cp for s in grads)
        for s in sorted(grads):  # summed in step order, as the simulation does
            own.add_(got[sources.index((r + s) % cp) * n:][:n])
    dk, dv = unflat_kv_grads(own, k.shape, len(ring.chunks(ring.rank)))
    return uses.tie(dq.to(q.dtype)), dk.to(k.dtype), dv.to(v.dtype)


class MaskedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, position_ids, key_padding, seq_idx, group_name, rank, cp, causal, scale,
                accumulate, load_balance, window, fewest_roundings):
        parts = len(rank_chunks(rank, cp, load_balance)) if cp > 1 else 1
        ring = MaskedRing(rank, cp, causal, load_balance, scale, accumulate, q.shape[2] // parts, window,
                          any(t is not None for t in (position_ids, key_padding, seq_idx)), fewest_roundings,
                          group_name, window_on_positions=seq_idx is not None)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        tokens = gather_tokens(position_ids, key_padding, cp, group_name, load_balance, q.shape[2] * cp, seq_idx)
        out, lse, saved = _ring_forward(q, k, v, tokens, ring)
        ctx.ring, ctx.has = ring, tuple(t is not None for t in tokens)
        ctx.save_for_backward(q, k, v, saved, lse, *(t for t in tokens if t is not None))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        tokens = tuple(rest.pop(0) if has else None for has in ctx.has)
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, tokens, ctx.ring)
        return (dq, dk, dv) + (None,) * 12
