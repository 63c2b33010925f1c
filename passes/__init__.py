"""gradsched's FX passes: pure graph-to-graph functions, composed in one visible pipeline.

The pipeline, in the order the passes run, the graph each rewrites and when it applies, is written once:
`gradsched.sync.pass_pipeline.PIPELINE` (docs/design.md's pass table is tested against it). Each pass's module
docstring states the invariant it establishes and what it assumes.

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
