"""Session set-up shared by every test module.

Without a GPU, Triton kernels run in Triton's interpreter (tests/test_triton_attention.py).
TRITON_INTERPRET must be set before triton is first imported (Inductor imports it), because
triton.language's own helpers (tl.zeros, tl.max, ...) are wrapped at that import.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
