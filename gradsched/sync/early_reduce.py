"""Reductions a rank of several stages issues during the schedule, as each of its stage graphs finishes a step.

Under a zero-bubble schedule (B and W, gradsched.sync.runtime) with several stages a rank, a stage graph's
gradients are final once its last micro-batch's W has run, while the rank's other stages still compute: in a V,
rank 0's last stage finishes long before its first. The rank's plan (rank_stages.build_union, from the order
the stage graphs finished on the first step) puts each bucket whose every gradient is final at such a point in
that point's early graph ("early{j}"). `finished` runs it right there, after the W whose gradients it reads
(a data dependence through .grad), and does not wait: its reduce-scatters fly while the remaining B and W run.
The flush waits for them after issuing its own (`wait`). Every rank of the gradient group runs the same
schedule, so they issue the early graphs in the same order; the agreement checks it on each.

The first step has no plan until its flush (every stage graph compiles during it): it records the order, and
its flush runs every early graph first (`catch_up`), in the order later steps run them.
"""
from __future__ import annotations

import torch

from gradsched.sync.watchdog import JOURNAL

WAIT = torch.ops._c10d_functional.wait_tensor.default


class EarlyReductions:
    def __init__(self):
        self.first_order: list[int] = []  # the first step: the order the stage graphs finished in
        self.done = 0  # stage graphs finished this step
        self.pending: list = []  # (SyncGraph, its outputs) issued this step and not yet waited for
        self.log: list[tuple[str, int]] = []  # (graph, stage graphs finished when issued), the last 64: tests

    def order(self, parts: int) -> tuple[int, ...]:
        """The finishing order, when every part finished once on the first step (else () : no early graphs)."""
        return tuple(self.first_order) if sorted(self.first_order) == list(range(parts)) else ()

    def finished(self, sync, part: int) -> None:
        """Stage graph `part` ran its last W of the step: its point's early graph, if any, is issued now."""
        built = sync.built
        if built is None:  # the first step: no plan yet
            self.first_order.append(part)
            return
        if not built.order:  # planned without (shard=False, or a part that never finished the first step)
            return
        j, self.done = self.done, self.done + 1
        if j >= len(built.order) or built.order[j] != part:
            raise RuntimeError(f"gradsched: stage graph {part} of pipeline rank {sync.setup.stage} finished its step "
                               f"in position {j}, where the first step's order {list(built.order)} (which the early "
                               "reductions were planned by) has another: the schedule must run the same every step.")
        sg = built.graphs.get(f"early{j}")
        if sg is not None:
            self._issue(sync, sg)

    def catch_up(self, sync) -> None:
        """The first step's flush: the early graphs its plan has, in order, not yet run."""
        self.done = len(sync.built.order)
        for j in range(self.done):
            sg = sync.built.graphs.get(f"early{j}")
            if sg is not None:
                self._issue(sync, sg)

    def _issue(self, sync, sg) -> None:
        sync._check_once(sg)
        params = sync.built.params
        grads = [params[n] for n in sg.inputs]
        with JOURNAL.entry(f"the early reduction graph {sg.where[5:]} of pipeline rank {sync.setup.stage} "
                           f"(buckets {[b.index for b in sg.layout.buckets]}, issued)"):
            outs = list(sg.fn([p.grad if p.grad is not None else torch.zeros_like(p) for p in grads]))
        for p in grads:
            p.grad = None  # their buckets hold them now (kept alive in `outs` until the wait)
        self.pending.append((sg, outs))
        self.log.append((sg.where, self.done))
        del self.log[:-64]

    def wait(self, results: dict) -> None:
        """At the flush: every early graph's reduced shards, into `results` (bucket index -> shard)."""
        for sg, outs in self.pending:
            with JOURNAL.entry(f"the early reduction graph {sg.where[5:]} (waited at the flush)"):
                shards = [WAIT(t) for t in outs[:len(sg.layout.buckets)]]
            results.update(zip((b.index for b in sg.layout.buckets), shards))
        self.pending.clear()
        self.done = 0

    def reset(self, planned: bool = True) -> None:
        """A step starts (or ended). What a step that failed part way issued is waited for and dropped (never
        left in flight: its work and tensors would stay registered); an error then is the failed step's own.
        Before the plan (`planned` False: the first step failed), the order seen so far is forgotten."""
        for sg, outs in self.pending:
            try:
                with JOURNAL.entry(f"the early reduction graph {sg.where[5:]} of a step that failed (drained)"):
                    for t in outs[:len(sg.layout.buckets)]:
                        WAIT(t)
            except Exception:  # noqa: BLE001 - the step already failed, and says why
                pass
        self.pending.clear()
        self.done = 0
        if not planned:
            self.first_order.clear()
