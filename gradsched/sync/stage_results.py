"""What the optimizer, the schedule report, clipping, checkpoints and the tests read of a stage's gradient
sync once its graphs are built: its plan, parameters, this step's reduced buckets, the report. GradSync
(gradsched.sync.runtime), which runs the graphs, holds these reads; none of them runs a graph, and only
`full_parameters` under shard="params" talks to other ranks (`finish_param_gather` waits for gathers every rank
issued in its optimizer step)."""
from __future__ import annotations

import torch

from gradsched.sync import schedule_report
from gradsched.sync.owners import all_inside
from gradsched.sync.stage_build import BuiltStage, SyncGraph
from gradsched.sync.stage_setup import process_group


class StageResults:
    """The reads of GradSync: `built`, `results`, `setup`, `options`, `param_shards`, `canonical`, `verdicts` and
    `attention_reports` are the executor's."""

    def _require_built(self) -> BuiltStage:
        if self.built is None:
            raise RuntimeError("gradsched: no backward graph has been compiled for this stage yet: run a "
                               "forward and backward first.")
        return self.built

    @property
    def sync_plan(self):
        """The stage's SyncPlan (None before its backward graph is compiled)."""
        return None if self.built is None else self.built.plan

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """The stage's trained parameters by name, as the plan names them."""
        return self._require_built().params

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The stage's parameters by name, whole and detached. Under shard="params" they are gathered from
        the shards into new tensors (a collective: every rank of the gradient group calls it), since the
        parameters' own storage is released."""
        self.finish_param_gather()
        if self.param_shards is None:
            return {n: p.detach() for n, p in self.params.items()}
        return self.param_shards.gathered(process_group(self.setup.grad_group))

    def finish_param_gather(self) -> None:
        """Wait for the optimizer's parameter all-gathers still in flight (shard=True) and write them into the
        parameters: before anything reads the parameters (a forward graph, a checkpoint, full_parameters). A wait
        on gathers every rank issued in its optimizer step, no new collective: one rank may call it alone."""
        land, self.pending_gather = self.pending_gather, None
        if land is not None:
            land()

    @property
    def ties(self) -> dict:
        return self.setup.ties

    def reduced(self) -> list[torch.Tensor]:
        """This step's reduced buckets (shards, or whole buckets with shard=False) in layout order;
        shorter until every graph of the step has run."""
        return [self.results[b.index] for b in self._require_built().plan.layout.buckets if b.index in self.results]

    def reduced_storage(self) -> list[torch.Tensor]:
        """The fewest tensors holding this step's reduced gradients, each element once: the reduced buckets
        (shards, or whole buckets where every .grad is a view of one: shard=False), else `gradients()`."""
        buckets = self.reduced()
        if len(buckets) != len(self._require_built().plan.layout.buckets):
            return self.gradients()
        if self.built.plan.shard:
            return buckets
        grads = self.gradients()
        return buckets if all_inside(grads, buckets) else grads

    def gradients(self) -> list[torch.Tensor]:
        """The tensors holding this step's reduced gradients, each element once: the reduced shards (shard=True or
        "params"), else each parameter's .grad (views of the all-reduced buckets)."""
        if self._require_built().plan.shard:
            return self.reduced()
        return [p.grad for p in self.params.values() if p.grad is not None]

    def clear_results(self) -> None:
        """The optimizer has consumed this step's reduced buckets."""
        self.results.clear()

    def sync_graphs(self) -> list[SyncGraph]:
        """The built sync graphs, in run order: the backward's or the early ones, then the flush's."""
        graphs = self._require_built().graphs
        return [graphs[w] for w in sorted(graphs, key=lambda w: (w == "flush", len(w), w))]

    def schedule_report(self) -> str:
        b = self._require_built()
        local = {}
        for name, kept in (self.canonical or {}).items():
            local.setdefault(kept, [kept]).extend([name] if name != kept else [])
        return (schedule_report.schedule_report(self.setup, b.plan, self.sync_graphs(), self.verdicts, self.options,
                                                list(local.values()))
                + schedule_report.attention_report(self.attention_reports))

    def tied_bytes_per_step(self) -> int:
        return sum(schedule_report.tied_bytes(sg.gm) for sg in self.sync_graphs())
