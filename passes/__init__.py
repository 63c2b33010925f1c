"""gradsched's FX passes: pure graph-to-graph functions, composed in one visible pipeline.

The gradient-sync pipeline, run on each stage's backward graph by `gradsched.sync.stage_build`
(steps 2 and 2b through `gradsched.sync.sync_plan.plan_sync`, whose SyncPlan is the plain-data
result the later steps and the optimizer are handed; step 4 by `gradsched.sync.preflight`, before a
graph's first collective; `gradsched.sync.runtime` only runs the graphs):

  1. grad_ready_order   (grad_ready_order.py)  read the order gradients become ready
  2. plan_buckets       (bucketing.py)         flat buckets in that order, shard-sized, the
                                               last one small; a tied gradient alone
  2b. place_buckets     (bucketing.py)         which graph reduces each bucket: the last
                                               micro-batch's backward, or the flush (tied
                                               buckets under placement="split")
  3. insert_grad_sync   (grad_sync.py)         tie all-reduce -> bucket reduce-scatter
                                               (a data dependence), per mode, on each graph
  3b. sink_waits        (sink_waits.py)        each collective's wait just before its first
                                               use: the backward computes while reductions
                                               fly (Inductor's raise_comms and sink_waits
                                               keep it in the generated code)
  3c. defer_waits       (defer_waits.py)       several stages a rank, the early graphs only: their
                                               reductions returned in flight (on the compiled copy)
  4. verify_graph       (verify.py)            prove the order or the alignment, per tie
  5. insert_agreement   (agreement.py)         on the copy that is compiled (every graph
                                               gradsched compiles, forward graphs too): each
                                               group's collectives open with an all-gather of
                                               their digest and a check that the peers' match

Context parallelism (context_parallel.py) lowers attention into ring steps on the
forward graph, before AOTAutograd. With shard="params", gather_params (param_gather.py)
rewrites the forward graph and the backward graph first (gradsched.sync.stage_build): every
parameter is read from its bucket, all-gathered just before use, one bucket ahead.

Each pass's module docstring states the invariant it establishes and what it assumes.
`GRADSCHED_PRINT_GRAPHS=1` prints each stage's backward graph before the pipeline
(gradsched/sync/sync_graphs.py) and the graph it produces.

May import: torch and networkx only, never the rest of gradsched: a pass is a function from
(graph, spec) to (graph, record), and what it needs comes in its spec.
"""
from .bucketing import BucketLayout, place_buckets, plan_buckets
from .grad_ready_order import GradSpec, grad_ready_order
from .grad_sync import SyncSpec, insert_grad_sync
from .sink_waits import SinkRecord, sink_waits
from .verify import TieCheck, TieLayout, TiedGradientHazard, Verdict, check, verify_graph


__all__ = ["BucketLayout", "GradSpec", "SyncSpec", "TieCheck", "TieLayout", "TiedGradientHazard", "Verdict",
           "SinkRecord", "check", "grad_ready_order", "insert_grad_sync", "place_buckets", "plan_buckets", "sink_waits",
           "verify_graph"]
