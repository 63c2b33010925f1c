"""The three ways in: torch.compile(backend="gradsched"), the decorator, and the registered name."""
import subprocess
import sys

from gradsched.launch import run_ranks
import pytest

from tied_training import Job, compare, gradient_error, reference

from rank_fns import backend_name_refusal, compile_with_backend_name, decorated_class


def test_backend_is_registered_by_name_without_importing_gradsched():
    code = "import torch._dynamo as d, sys; print('gradsched' in d.list_backends(), 'gradsched' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


@pytest.mark.parametrize("options,distributed_optimizer", [
    ({"compiler": "eager"}, True),  # the defaults: shard=True, the distributed optimizer found from the model
    ({"shard": False}, False),  # plain data parallel, an ordinary optimizer, Inductor
], ids=["default_options_distributed_optimizer", "all_reduce_ordinary_optimizer_inductor"])
def test_torch_compile_with_backend_name_trains_like_one_process(options, distributed_optimizer):
    job = Job(pp=1, dp=2, optimizer="sgd", lr=0.5)
    ref = reference(job)
    ranks = run_ranks(compile_with_backend_name, 2, job, options, distributed_optimizer, timeout_s=300)
    assert gradient_error(ref, ranks) < 1e-5
    cmp = compare(ref, ranks)
    assert cmp["max_abs_diff"] < 1e-5 and cmp["uncovered"] == []


@pytest.mark.parametrize("options,named", [({"microbatches": 2}, "microbatches=2"),
                                           ({"shard": "params"}, "shard='params'")])
def test_torch_compile_with_backend_name_refuses_what_only_a_driver_can_run(options, named):
    msg = run_ranks(backend_name_refusal, 2, options)[0]
    assert named in msg and "gradsched.parallelize" in msg


def test_decorator_on_a_model_class_trains_the_pipeline_like_one_process():
    job = Job(pp=2, dp=1)
    cmp = compare(reference(job), run_ranks(decorated_class, 2, job, timeout_s=200))
    assert cmp["max_abs_diff"] < 1e-5 and cmp["tied_bitwise_equal"] and cmp["uncovered"] == []
