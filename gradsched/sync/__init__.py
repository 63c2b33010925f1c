"""The gradient sync of one pipeline stage: from its parameters and ties to compiled graphs.

Data flows one way: stage_setup (what a stage is given, plain data) -> sync_plan (SyncPlan: the
buckets and who reduces them, plain data) -> sync_graphs (the pass pipeline of gradsched.passes,
step by step) -> stage_build (compiled graphs, via compile) -> preflight and fingerprint (checked
before the first collective, on every rank) -> runtime (GradSync, which only runs them). ties
finds which parameters are one weight; report prints the plan per rank; compiled_code reads
what Inductor's output code does, in order. agreement opens every compiled graph's collectives
with the peers' agreement (each run); param_shards holds the parameters as shards under
shard="params" (laid out when the forward graph compiles). When a rank misbehaves: watchdog (the
journal and heartbeat) with peers and stuck (who the job waits for), replicas (every stage's replicas
start equal), boundaries (pipeline shapes agreed before the first send) and nonfinite (a non-finite
step is never applied).

May import: gradsched.passes, gradsched.cp (the report names CP calls) and the foundation
modules (plan, options, user_errors). Never training or the public API.
"""
