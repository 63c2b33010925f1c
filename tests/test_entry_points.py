"""The three ways in: torch.compile(backend="gradsched"), the decorator, and the registered name."""
import subprocess
import sys

from gradsched.launch import run_ranks
from gradsched.tied_training import Job, compare, reference

from rank_fns import compile_with_backend_name, decorated_class


def test_backend_is_registered_by_name_without_importing_gradsched():
    code = "import torch._dynamo as d, sys; print('gradsched' in d.list_backends(), 'gradsched' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_torch_compile_with_backend_name_trains_plain_data_parallel_like_one_process():
    job = Job(pp=1, dp=2)
    cmp = compare(reference(job), run_ranks(compile_with_backend_name, 2, job, timeout_s=200))
    assert cmp["max_abs_diff"] < 1e-5 and cmp["uncovered"] == []


def test_decorator_on_a_model_class_trains_the_pipeline_like_one_process():
    job = Job(pp=2, dp=1)
    cmp = compare(reference(job), run_ranks(decorated_class, 2, job, timeout_s=200))
    assert cmp["max_abs_diff"] < 1e-5 and cmp["tied_bitwise_equal"] and cmp["uncovered"] == []
