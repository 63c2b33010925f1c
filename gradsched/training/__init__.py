"""Training on top of the gradient sync: the distributed optimizer and what it steps.

optimizer (DistributedOptimizer over this rank's shards), shards (which elements a rank holds),
param_groups (options by parameter name), clipping (the global norm as one process computes
it), checkpoint and checkpoint_files (layout-free save and load, verified before anything is
restored), the entry point's pieces (run_io: data, schedule, progress, metrics), live_bytes (what a step holds, counted as
it runs: the dry run's measure), loss_weights (the global batch's loss from each rank's share), and
host_reads (which lines of a step read a tensor's value on the host), pipeline_split (what
torch.distributed.pipelining's split loses, checked or put back), pipeline_schedule (its schedules run with
gradsched's compiled graphs, B and W apart for zero bubble), virtual_stages (several stages a rank),
stage_balance (split points that balance the ranks), and a parallel model's parts: pipeline_build (its
construction), step_driver (its step), stage_values (its stage's values before the first graph) and model_state
(what it trains, under which names).

May import: gradsched.sync, gradsched.cp, gradsched.passes and the foundation modules. Never
the public API modules above it (parallel, backend, hf): a parallel model is reached through its ModelState
(`model_state.state_of(model)`), not by importing its class; the compiler is handed in.
"""
