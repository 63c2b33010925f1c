"""Attention work per context-parallel rank (gradsched.cp_balance), against sums worked by hand."""
import torch

from gradsched.cp_balance import imbalance, pairs_per_rank


def test_one_causal_sequence_is_spread_evenly_by_the_balanced_layout():
    work = pairs_per_rank(torch.arange(64)[None], 4)
    assert imbalance(work) == 1.0 and sum(work) == 64 * 65 // 2


def test_unequal_documents_unbalance_it():
    # S=8, cp=2, documents of 6 and 2 tokens: a query sees 1, 2, ... keys of its own document.
    # Rank 0 holds tokens 0, 1, 6, 7 (1 + 2 + 1 + 2 = 6 pairs), rank 1 tokens 2..5 (3 + 4 + 5 + 6 = 18).
    work = pairs_per_rank(torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]]), 2)
    assert work == [6, 18] and imbalance(work) == 1.5
