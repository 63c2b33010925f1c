"""Turn a (post-pass) aten-level FX graph into a boxed callable: Inductor or eager."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import make_boxed_func

from gradsched.sync import pass_pipeline
from gradsched.sync.agreement_check import agreement_spec, publish, settling
from gradsched.sync.pass_pipeline import Later


# Inductor's own comm scheduling (torch/_inductor/comms.py), for graphs that reduce gradients:
# raise_comms issues each collective as soon as its inputs are computed (its memory-saving
# reorder otherwise delays them next to their waits), sink_waits keeps each wait as late as the
# graph's data dependences allow (under shard=True, just before the next bucket's reduce-scatter:
# passes/grad_sync.py). Neither moves a collective past another: the order every rank of a group
# shares stays the graph's.
COMM_OVERLAP = {"reorder_for_compute_comm_overlap": True,
                "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"]}


def compile_graph(gm: fx.GraphModule, example_inputs, compiler: str, comm_overlap: bool = False,
                  agree: str | None = None, defer: bool = False):
    """Boxed callable (takes one list of tensors). compiler: "inductor" | "eager".
    comm_overlap: schedule the graph's collectives early and their waits late (Inductor).
    agree: the graph's name in messages; each run then agrees with the peers on each group's collectives
    (gradsched.sync.agreement_check), on a copy: `gm` stays the graph gradsched built.
    defer: the graph returns its reductions in flight, their inputs appended (passes/defer_waits.py), on a copy."""
    if agree is not None or defer:
        # the pass pipeline's entries for the compiled copy (gm stays the graph gradsched built)
        copy = fx.GraphModule(gm, gm.graph.__deepcopy__())
        copy.meta.update(gm.meta)
        conditions = pass_pipeline.Conditions(check_ranks=agree is not None, where="early" if defer else "")
        specs = {"insert_agreement": Later(lambda _: agreement_spec(copy)), "defer_waits": None}
        records = pass_pipeline.run("compiled", copy, conditions, specs, what=agree or "an early graph")
        if "insert_agreement" in records:
            publish(records["insert_agreement"], agree)
        fn = compile_graph(copy, example_inputs, compiler, comm_overlap)
        return settling(fn) if agree is not None else fn
    if compiler == "eager":
        from gradsched.user_errors import remember_graph
        remember_graph(gm)  # its errors can then name the user's line
        return make_boxed_func(gm.forward)
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    from gradsched.passes.graph_utils import fake_mode_of

    if comm_overlap:
        import torch._inductor.config as inductor_config
        with inductor_config.patch(COMM_OVERLAP):
            return compile_graph(gm, example_inputs, compiler)
    # Inductor rewrites the graph it compiles in place (its reinplacing turns a functional
    # all_reduce into all_reduce_): compile a copy, so that the verifier, the report and the
    # cross-rank check read the graph gradsched built
    gm, built = fx.GraphModule(gm, gm.graph.__deepcopy__()), gm
    gm.meta.update(built.meta)
    fake = detect_fake_mode(example_inputs)
    with one_compile_per_host(gm, example_inputs):
        if fake is None:  # a graph built by gradsched itself (the flush graph): give Inductor fake inputs
            fake = fake_mode_of(gm)
            fake_inputs = [fake.from_tensor(t, static_shapes=True) for t in example_inputs]
            with V.set_fake_mode(fake), fake:
                compiled = compile_fx_inner(gm, fake_inputs)
        else:
            compiled = compile_fx_inner(gm, example_inputs)
    if getattr(compiled, "_boxed_call", False):
        return compiled
    return make_boxed_func(compiled)


LOCKS_ENV = "GRADSCHED_COMPILE_LOCKS"  # a folder: set by gradsched.launch for the ranks it starts on this host


@contextlib.contextmanager
def one_compile_per_host(gm: fx.GraphModule, example_inputs):
    """Ranks of one host about to compile the same graph take turns (a file lock per graph, in the folder
    $GRADSCHED_COMPILE_LOCKS): the first compiles it, the others then find it in Inductor's cache (a read of
    ~1 s) instead of all compiling it at once (4 ranks on 2 cores: ~40 s each). Only Inductor's compile is
    inside: nothing there waits for another rank, so a turn always ends. Without the variable (torchrun, a
    cluster, where devices differ per rank and the graphs with them), nothing is taken."""
    where = os.environ.get(LOCKS_ENV)
    if not where:
        yield
        return
    shapes = [(tuple(t.shape), t.dtype, t.device.type) for t in example_inputs if isinstance(t, torch.Tensor)]
    key = hashlib.sha1((gm.code + repr(shapes)).encode()).hexdigest()
    with open(os.path.join(where, key), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies holding it
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
