"""Where each context-parallel rank's tokens come from, and how to put outputs back.

Load-balanced layout (load_balance=True, what the causal ring expects): the sequence
is cut into 2*cp equal chunks and rank r holds chunks r and 2cp-1-r, in that order.
Under a causal mask the early chunk has little to attend to and the late one much, so
every rank gets the same work. Plain layout (load_balance=False): rank r holds chunk r
of cp.

    cp=2, S=8:  rank 0 holds positions 0 1 | 6 7   rank 1 holds 2 3 | 4 5

Document-balanced layout (load_balance="documents", for packed documents): the head-tail cut
balances ONE causal sequence; with packed documents a rank holding the ends of long documents
works more (gradsched.cp.balance measures it). So each batch row is first reordered, from its
own position ids, into a sequence whose head-tail cut gives every rank a near-equal share of
every document: document d is cut into 2cp consecutive pieces of floor or ceil(len_d / 2cp)
tokens, piece k going into the k-th of 2cp equal chunks (`document_order`). Within a document
the order of its tokens is kept, so causality is still sequence order; documents are no longer
contiguous, so the model is told them explicitly (`seq_idx`, gradsched.cp.attention_masks) and a window is
measured on positions.

Everything a rank feeds the model is cut the same way, so each token keeps its own
position id (rotary embeddings read positions from position_ids, not from the index
in the local tensor) and its own label. Labels are shifted for next-token prediction
BEFORE cutting: the label of position t is token t+1, which may sit on another rank.
The loss must then not shift again (Hugging Face: pass them as `shift_labels=`), and
a mean over tokens must be taken over the whole sequence: sum the local losses and
divide by the number of labelled tokens of all ranks.
"""
from __future__ import annotations

import torch


class CPLayoutError(ValueError):
    """A sequence that cannot be cut into the context-parallel layout."""


def rank_chunks(rank: int, cp: int, load_balance: bool = True) -> tuple[int, ...]:
    """The chunk indices rank holds, in local order (chunks of S/(2cp), or S/cp if plain)."""
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def _check(seq_len: int, cp: int, load_balance: bool) -> int:
    n = 2 * cp if load_balance else cp
    if seq_len % n:
        what = f"2*cp={n} (load-balanced layout)" if load_balance else f"cp={n}"
        raise CPLayoutError(
            f"context-parallel layout: the sequence length {seq_len} is not divisible by {what}. "
            f"Pad the sequence to a multiple of {n} with pad_to_multiple(), or change cp.")
    return seq_len // n


def shard_index(seq_len: int, cp: int, rank: int, load_balance: bool = True,
                device=None) -> torch.Tensor:
    """Positions (in the full sequence) that rank holds, in its local order."""
    size = _check(seq_len, cp, load_balance)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in rank_chunks(rank, cp, load_balance)])


def layout_order(seq_len: int, cp: int, load_balance: bool = True, device=None) -> torch.Tensor:
    """Full-sequence position of each slot of the ranks' shards laid end to end."""
    return torch.cat([shard_index(seq_len, cp, r, load_balance, device) for r in range(cp)])


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1, load_balance: bool = True):
    """The part of x (whole sequence along `dim`) that rank holds."""
    return x.index_select(dim, shard_index(x.shape[dim], cp, rank, load_balance, x.device))


def unshard(shards, cp: int, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """Inverse of shard: every rank's part (a list in rank order) -> the natural order."""
    if len(shards) != cp:
        raise CPLayoutError(f"unshard: {len(shards)} shards given for cp={cp}; pass one per rank.")
    laid = torch.cat(list(shards), dim=dim)
    order = layout_order(laid.shape[dim], cp, load_balance, laid.device)
    return laid.index_select(dim, torch.argsort(order))


def gather_sequence(x: torch.Tensor, group, dim: int = 1, load_balance: bool = True):
    """All ranks' parts of a sequence tensor (the CP group by name or ProcessGroup), in
    natural order. Not differentiable: for outputs, metrics and checks."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    cp = dist.get_world_size(group)
    laid = fc.wait_tensor(fc.all_gather_single(x.contiguous(), dim, group))
    return unshard(laid.chunk(cp, dim=dim), cp, dim, load_balance)


def document_order(position_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, S] position ids in natural order (a new document wherever they do not step by 1) ->
    [B, S]: the natural index of each token of the document-balanced sequence (see above), per row.

    Each document's remainder tokens (len mod 2cp) go one each to consecutive chunks, carried on
    cyclically from the previous document, so that every chunk ends with exactly S / 2cp tokens."""
    from gradsched.cp.attention_masks import document_ids

    _check(position_ids.shape[-1], cp, True)
    return torch.stack([_row_order(doc, 2 * cp) for doc in document_ids(position_ids)])


def _row_order(doc: torch.Tensor, n: int) -> torch.Tensor:
    """document_order of one row, doc [S] its document ids (0, 1, ..., non-decreasing), as tensor
    arithmetic over the [documents, n] pieces (no per-token host loop)."""
    lengths = torch.bincount(doc)
    base, extra = lengths // n, lengths % n
    carry = (torch.cumsum(extra, 0) - extra) % n  # the chunk that takes a document's first extra token
    k = torch.arange(n, device=doc.device)
    sizes = base[:, None] + (((k[None, :] - carry[:, None]) % n) < extra[:, None]).long()  # [docs, n]
    natural = (torch.cumsum(lengths, 0) - lengths)[:, None] + torch.cumsum(sizes, 1) - sizes
    sizes, natural = sizes.t().reshape(-1), natural.t().reshape(-1)  # chunk-major: the balanced order
    placed = torch.cumsum(sizes, 0) - sizes
    return torch.repeat_interleave(natural - placed, sizes) + torch.arange(doc.shape[0], device=doc.device)


def balance_documents(position_ids: torch.Tensor, cp: int, *tensors: torch.Tensor) -> tuple:
    """(seq_idx, the tensors) of each row reordered into the document-balanced sequence, to be cut
    by `shard` with load_balance=True. tensors: [B or 1, S, ...] per-token (inputs, position ids,
    targets already shifted, padding); seq_idx [B, S]: each token's document."""
    from gradsched.cp.attention_masks import document_ids

    order = document_order(position_ids, cp)
    rows = order.shape[0]

    def take(t):
        idx = order.view(rows, -1, *([1] * (t.dim() - 2))).expand(rows, -1, *t.shape[2:])
        return t.expand(rows, *t.shape[1:]).gather(1, idx)

    return (take(document_ids(position_ids)),) + tuple(take(t) for t in tensors)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100, dim: int = 1) -> torch.Tensor:
    """Next-token targets: position t gets labels[t+1]; the last position gets ignore_index."""
    shifted = labels.roll(-1, dims=dim)
    shifted.narrow(dim, labels.shape[dim] - 1, 1).fill_(ignore_index)
    return shifted


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1, value=0) -> torch.Tensor:
    """x padded at the end of `dim` to a multiple of `multiple` (e.g. 2*cp)."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def shard_causal_lm_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                          position_ids: torch.Tensor | None = None, *, cp: int, rank: int,
                          load_balance: bool | str = True, ignore_index: int = -100) -> dict:
    """A rank's share of a causal-LM batch ([B, S] tensors): input_ids, position_ids and,
    given labels (unshifted, as Hugging Face takes them), shift_labels: already shifted
    for next-token loss, so each rank scores exactly the positions it holds.

    load_balance="documents": packed documents (position ids restarting) spread evenly over the
    ranks (`document_order`); the batch then also has seq_idx, each token's document, which the
    model must hand to its attention (gradsched.masks.attention(seq_idx=...); gradsched.hf.CausalLM
    takes it as its fourth argument)."""
    seq = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    named = {"input_ids": input_ids, "position_ids": position_ids}
    if labels is not None:
        named["shift_labels"] = shift_labels(labels, ignore_index)
    if load_balance == "documents":
        seq_idx, *moved = balance_documents(position_ids, cp, *named.values())
        named = dict(zip(named, moved), seq_idx=seq_idx)
    return {name: shard(t, cp, rank, 1, bool(load_balance)) for name, t in named.items()}


def check_takes_seq_idx(model: torch.nn.Module) -> None:
    """load_balance="documents" calls the model with (tokens, positions, attention_mask, seq_idx)."""
    import inspect
    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(params) >= 4:
        return
    raise ValueError(
        f"load_balance='documents' calls {type(model).__name__} with (tokens, positions, attention_mask, seq_idx): "
        "each sequence is reordered so that every rank holds a piece of every document, and seq_idx says which "
        f"document each token is in; its forward takes {[p.name for p in params]}. Take seq_idx and hand it to "
        "gradsched.masks.attention(..., seq_idx=) (gradsched.hf.CausalLM does), or use load_balance=True.")


def model_inputs(plan, load_balance, inputs, targets, positions=None, attention_mask=None):
    """ParallelModel.train_step's inputs and targets: the model's inputs as a tuple; under context parallelism
    (plan.cp > 1), this rank's slice of the sequence, laid out by `load_balance` (SyncOptions').

    The model gets (tokens), (tokens, positions) or (tokens, positions, attention_mask):
    under context parallelism each rank holds non-contiguous chunks, so positions come in
    explicitly (learned or rotary embeddings read them; packed documents restart them).
    Under load_balance="documents" it gets (tokens, positions, attention_mask, seq_idx): each
    row reordered so every rank holds a share of every document (balance_documents), and seq_idx says which document each token is in. attention_mask is
    then all ones where none was given (a pipeline split drops an input passed as None, and
    seq_idx would take its place).
    """
    for name, t in (("positions", positions), ("attention_mask", attention_mask)):
        if t is not None and tuple(t.shape) != tuple(inputs.shape[:2]):
            raise ValueError(f"train_step: {name} has shape {tuple(t.shape)}, and the inputs "
                             f"{tuple(inputs.shape[:2])}. Pass one per token, [batch, sequence].")
    if positions is None and (plan.cp > 1 or attention_mask is not None):
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[:2])
    args = tuple(t for t in (inputs, positions, attention_mask) if t is not None)
    if plan.cp == 1:
        return args, targets
    cp, r, lb = plan.cp, plan.index("cp"), load_balance
    if lb == "documents":
        if attention_mask is None:
            attention_mask = torch.ones(inputs.shape[:2], dtype=torch.long, device=inputs.device)
        seq_idx, inputs, targets, positions, attention_mask = balance_documents(
            positions, cp, inputs, targets, positions, attention_mask)
        args = (inputs, positions, attention_mask, seq_idx)
    return tuple(shard(t, cp, r, 1, bool(lb)) for t in args), shard(targets, cp, r, 1, bool(lb))
