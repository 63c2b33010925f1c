"""Session set-up shared by every test module.

Without a GPU, Triton kernels run in Triton's interpreter (tests/test_triton_attention.py).
TRITON_INTERPRET must be set before triton is first imported (Inductor imports it), because
triton.language's own helpers (tl.zeros, tl.max, ...) are wrapped at that import.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def inductor_runs():
    """The option matrix's Inductor rows, run once for every module that reads them (each is a cold compile):
    tests/test_option_matrix.py compares them with one process, tests/test_host_reads.py reads their steps."""
    from test_option_matrix import INDUCTOR, run_jobs
    return run_jobs(INDUCTOR)
