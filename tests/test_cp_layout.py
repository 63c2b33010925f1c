"""The context-parallel sequence layout (gradsched.cp.layout)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsched.cp.layout import (CPLayoutError, document_order, gather_sequence, pad_to_multiple, shard,
                                 shard_causal_lm_batch, shard_index, shift_labels, unshard)
from gradsched.launch import run_ranks


def test_balanced_layout_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert shard_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_index(16, 4, 1).tolist() == [2, 3, 12, 13]


def test_plain_layout_gives_rank_r_chunk_r():
    assert shard_index(8, 2, 1, load_balance=False).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_shards_cover_every_position_exactly_once(cp, load_balance):
    held = torch.cat([shard_index(32, cp, r, load_balance) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(32))


@pytest.mark.parametrize("load_balance", [True, False])
def test_unshard_inverts_shard_along_any_dim(load_balance):
    x = torch.randn(2, 3, 16, 5)
    parts = [shard(x, 4, r, dim=2, load_balance=load_balance) for r in range(4)]
    assert torch.equal(unshard(parts, 4, dim=2, load_balance=load_balance), x)


def test_each_rank_gets_the_position_ids_of_the_tokens_it_holds():
    ids = torch.arange(100, 116).view(1, 16)
    for r in range(4):
        batch = shard_causal_lm_batch(ids, cp=4, rank=r)
        assert torch.equal(batch["input_ids"] - 100, batch["position_ids"])
        assert batch["position_ids"][0].tolist() == shard_index(16, 4, r).tolist()


def test_labels_are_shifted_before_sharding():
    # The label at position t is token t+1, even when t+1 lives on another rank.
    ids = torch.arange(16).view(1, 16)
    for r in range(2):
        batch = shard_causal_lm_batch(ids, labels=ids, cp=2, rank=r)
        pos = batch["position_ids"][0]
        expected = torch.where(pos == 15, -100, pos + 1)
        assert torch.equal(batch["shift_labels"][0], expected)


def test_summed_loss_over_shards_equals_the_full_sequence_loss():
    torch.manual_seed(0)
    vocab, seq, cp = 11, 16, 4
    ids = torch.randint(vocab, (2, seq))
    logits = torch.randn(2, seq, vocab, dtype=torch.float64)
    full = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum")
    total = 0.0
    for r in range(cp):
        batch = shard_causal_lm_batch(ids, labels=ids, cp=cp, rank=r)
        local_logits = shard(logits, cp, r, dim=1)
        total += F.cross_entropy(local_logits.reshape(-1, vocab), batch["shift_labels"].reshape(-1),
                                 ignore_index=-100, reduction="sum")
    assert torch.allclose(total, full, rtol=1e-12, atol=0)


def test_shift_labels_does_not_modify_its_input():
    labels = torch.arange(6).view(1, 6)
    assert shift_labels(labels).tolist() == [[1, 2, 3, 4, 5, -100]]
    assert labels.tolist() == [[0, 1, 2, 3, 4, 5]]


def test_sequence_not_divisible_by_twice_cp_is_refused_with_advice():
    with pytest.raises(CPLayoutError, match=r"length 12 is not divisible by 2\*cp=8.*pad_to_multiple"):
        shard(torch.zeros(1, 12), 4, 0)


def _packed(*lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


DOCUMENTS = [(6, 2, 13, 3), (1, 1, 1, 1, 1, 1, 1, 1, 8), (32,), (3, 29), (5, 18, 1, 26, 14)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", DOCUMENTS)
def test_document_order_cuts_each_document_into_2cp_near_equal_pieces_in_order(lengths, cp):
    order = document_order(_packed(*lengths), cp)[0].tolist()
    assert sorted(order) == list(range(sum(lengths)))  # every token once
    chunk = sum(lengths) // (2 * cp)
    start = 0
    for n in lengths:  # a document's tokens keep their order and fall into chunks as floor/ceil(n / 2cp)
        slots = [order.index(t) for t in range(start, start + n)]
        assert slots == sorted(slots)
        sizes = [sum(1 for s in slots if s // chunk == k) for k in range(2 * cp)]
        assert set(sizes) <= {n // (2 * cp), -(-n // (2 * cp))}, (n, sizes)
        start += n


def test_document_order_orders_each_batch_row_by_its_own_documents():
    rows = torch.cat([_packed(6, 2, 13, 3), _packed(5, 1, 18)])
    want = [document_order(r[None], 2)[0] for r in rows]
    assert torch.equal(document_order(rows, 2), torch.stack(want))


def test_document_order_of_one_document_is_the_natural_order():
    assert document_order(torch.arange(16)[None], 4)[0].tolist() == list(range(16))


def test_document_balanced_batch_keeps_each_tokens_position_label_and_document():
    pos = _packed(6, 2, 13, 3)
    tokens = torch.arange(100, 124)[None]
    parts = [shard_causal_lm_batch(tokens, tokens, pos, cp=2, rank=r, load_balance="documents") for r in (0, 1)]
    natural = {t: i for i, t in enumerate(tokens[0].tolist())}
    doc = [0] * 6 + [1] * 2 + [2] * 13 + [3] * 3
    for part in parts:
        for t, p, y, d in zip(*(part[k][0].tolist() for k in ("input_ids", "position_ids", "shift_labels",
                                                                "seq_idx"))):
            i = natural[t]
            assert (p, d) == (pos[0, i].item(), doc[i])
            assert y == (t + 1 if i < 23 else -100)  # shifted before the reordering
    assert sorted(sum((part["input_ids"][0].tolist() for part in parts), [])) == tokens[0].tolist()


def test_pad_to_multiple_pads_the_end_only():
    x = torch.ones(1, 5, dtype=torch.long)
    padded = pad_to_multiple(x, 4, value=7)
    assert padded.tolist() == [[1, 1, 1, 1, 1, 7, 7, 7]]
    assert pad_to_multiple(padded, 4) is padded


def _gather_worker(rank, world):
    torch.set_num_threads(1)
    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    group = dist.group.WORLD.group_name
    return [gather_sequence(shard(x, world, rank, dim=1, load_balance=lb), group, dim=1, load_balance=lb)
            for lb in (True, False)]


def test_gather_sequence_restores_natural_order_on_every_rank():
    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    for per_layout in run_ranks(_gather_worker, 2, timeout_s=120):
        for gathered in per_layout:
            assert torch.equal(gathered, x)
