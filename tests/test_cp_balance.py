"""Attention work per context-parallel rank (gradsched.cp.balance), against sums worked by hand."""
import torch

from gradsched.cp.balance import imbalance, pairs_per_rank


def test_one_causal_sequence_is_spread_evenly_by_the_balanced_layout():
    work = pairs_per_rank(torch.arange(64)[None], 4)
    assert imbalance(work) == 1.0 and sum(work) == 64 * 65 // 2


def test_unequal_documents_unbalance_it():
    # S=8, cp=2, documents of 6 and 2 tokens: a query sees 1, 2, ... keys of its own document.
    # Rank 0 holds tokens 0, 1, 6, 7 (1 + 2 + 1 + 2 = 6 pairs), rank 1 tokens 2..5 (3 + 4 + 5 + 6 = 18).
    work = pairs_per_rank(torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]]), 2)
    assert work == [6, 18] and imbalance(work) == 1.5


def test_the_document_balanced_layout_gives_each_rank_a_piece_of_every_document():
    # The same S=8, cp=2 documents: cut into 4 pieces each (6 -> 2, 2, 1, 1; 2 -> its two tokens go to the
    # next chunks, 2 and 3): chunks [0 1] [2 3] [4 6] [5 7]; rank 0 holds chunks 0 and 3 = tokens 0 1 5 7
    # (1 + 2 + 6 + 2 = 11 pairs), rank 1 chunks 1 and 2 = tokens 2 3 4 6 (3 + 4 + 5 + 1 = 13).
    work = pairs_per_rank(torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]]), 2, load_balance="documents")
    assert work == [11, 13]


def test_the_document_balanced_layout_evens_out_unequal_documents():
    # benchmarks/cp_numerics.py's documents (S=4096, cp=8): 1.381 in the head-tail layout
    pos = torch.cat([torch.arange(n) for n in (296, 404, 110, 507, 2779)])[None]
    assert imbalance(pairs_per_rank(pos, 8)) > 1.3
    assert imbalance(pairs_per_rank(pos, 8, load_balance="documents")) < 1.01
