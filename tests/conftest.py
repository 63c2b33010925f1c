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
# Inductor's C++ kernels without SIMD: choosing a vector tiling simplifies every index with sympy, and vector code
# compiles slower; together about a quarter of a cold compile here (the masked ring's: 177 s -> 126 s). The
# vectorizer is Inductor's own concern, and a GPU runs Triton; ranks and subprocesses inherit the setting.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


@pytest.fixture(scope="session")
def inductor_runs():
    """The option matrix's Inductor rows, run once for every module that reads them (each is a cold compile):
    tests/test_option_matrix.py compares them with one process, tests/test_host_reads.py reads their steps."""
    from test_option_matrix import INDUCTOR, run_jobs
    return run_jobs(INDUCTOR)
