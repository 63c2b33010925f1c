"""The pipeline's graphs for CUDA, checked on a CPU-only machine with fake CUDA tensors.

FakeTensorMode makes CUDA tensors without a GPU, and graph passes only read and write fake
values, so every graph gradsched builds can be checked for device-correctness here: each
node's value must be on the parameters' device, never on a default CPU one. What cannot run
here is autograd on fake CUDA tensors (the CPU-only build has no CUDA device guard), so the
backward graph is captured on CPU once and its values moved to fake CUDA before the passes run.
"""
from __future__ import annotations

import ast
import pathlib

import torch
import torch.fx as fx
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from gradsched.options import SyncOptions
from gradsched.passes.context_parallel import RingSpec, lower_attention_to_ring
from gradsched.passes.grad_ready_order import grad_ready_order
from gradsched.cp.ring_attention import check_attention_call, ring_attention
from gradsched.sync.sync_graphs import backward_sync_graph, flush_sync_graph
from gradsched.sync.sync_plan import Group, plan_sync

ROOT = pathlib.Path(__file__).resolve().parent.parent
FACTORIES = {"zeros", "empty", "ones", "full", "arange", "randn", "rand", "randint", "tensor", "eye",
             "linspace", "empty_strided"}


def tensor_devices(gm: fx.GraphModule) -> dict[str, str]:
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    return {name: v.device.type for name, v in vals.items() if isinstance(v, torch.Tensor)}


def on_cuda(gm: fx.GraphModule) -> None:
    devices = tensor_devices(gm)
    assert devices, "no node carries a value"
    elsewhere = {n: d for n, d in devices.items() if d != "cuda"}
    assert not elsewhere, f"nodes off the parameters' device: {elsewhere}"


def model_step(emb, w, head, x):
    """A tied-weight toy: the embedding table is also the LM head's weight."""
    h = torch.tanh(F.embedding(x, emb) @ w)
    return (h @ head.t()).logsumexp(-1).sum() + (h @ emb.t()).sum()


def cpu_backward_graph() -> fx.GraphModule:
    graphs = {}

    def grab(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    params = [torch.randn(16, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True),
              torch.randn(16, 8, requires_grad=True)]
    aot_function(model_step, fw_compiler=grab("fw"), bw_compiler=grab("bw"))(
        *params, torch.randint(0, 16, (2, 4))).backward()
    return graphs["bw"]


def to_fake_cuda(gm: fx.GraphModule) -> fx.GraphModule:
    """The same graph with every value a fake CUDA tensor of the same shape and dtype."""
    fake = FakeTensorMode()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            with fake:
                n.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
    return gm


def sync_plan_for(gm: fx.GraphModule, placement: str, options: SyncOptions = SyncOptions()):
    grads = dict(enumerate(("emb", "w", "head")))
    ready = grad_ready_order(gm, grads)
    dtypes = {r.name: r.dtype for r in ready}
    return plan_sync(ready, options, stage=0, rank=0, placement=placement,
                     grad_group=Group("dp", (0, 1), 0), tie_groups={"t": Group("tie", (0, 2), 0)},
                     ties={"emb": "t"}, param_dtypes=dtypes)


def test_the_backward_graph_for_cuda_parameters_syncs_on_cuda():
    bw = to_fake_cuda(cpu_backward_graph())
    plan = sync_plan_for(bw, "backward")
    for accumulate in (False, True):  # accumulate: earlier micro-batches' grads come in as inputs
        gm, record = backward_sync_graph(bw, plan, accumulate)
        on_cuda(gm)
        assert record.results  # the pass did insert the reductions


def test_the_flush_graph_for_cuda_parameters_is_on_cuda():
    plan = sync_plan_for(to_fake_cuda(cpu_backward_graph()), "flush")
    gm, _ = flush_sync_graph(plan, torch.device("cuda"))
    on_cuda(gm)


def test_the_tied_at_flush_placement_puts_both_graphs_on_cuda():
    bw = to_fake_cuda(cpu_backward_graph())
    plan = sync_plan_for(bw, "tied_at_flush")
    on_cuda(backward_sync_graph(bw, plan, accumulate=True)[0])
    on_cuda(flush_sync_graph(plan, torch.device("cuda"))[0])


def test_ring_lowering_of_cuda_attention_stays_on_cuda():
    def two_layers(q, k, v):
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(x, k, v, is_causal=True)

    gm = fx.symbolic_trace(two_layers)
    fake = FakeTensorMode()
    with fake:
        inputs = [torch.empty(1, 4, 16, 8, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    FakeTensorProp(gm, fake).propagate(*inputs)
    gm, report = lower_attention_to_ring(
        gm, RingSpec("cp", 2, attention=ring_attention, check=check_attention_call))
    assert len(report.lowered) == 2
    on_cuda(gm)


def test_nccl_runs_set_the_cuda_device_from_local_rank(monkeypatch):
    from gradsched import plan as plan_module

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(plan_module.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend)))
    for var, value in dict(RANK="3", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                           LOCAL_RANK="1").items():
        monkeypatch.setenv(var, value)
    plan_module.init_from_env(backend="nccl")
    assert calls == [("set_device", 1), ("init", "nccl")]


def test_every_tensor_factory_in_the_package_names_its_device():
    # A factory without device= makes a CPU tensor on a GPU run: the tests above cover the
    # graphs, this covers every other place.
    missing = []
    for path in sorted([*(ROOT / "gradsched").glob("*.py"), *(ROOT / "passes").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not missing, "\n".join(missing)
