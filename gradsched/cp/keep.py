"""Every collective a rank issues has a use on that rank, so no compiler can drop it there.

AOTAutograd treats functional collectives as pure ops: one whose result a rank's graph never
reads is dead code there, removed (or moved into the backward by the partitioner), while its
peers, whose graphs do read it, wait for it forever. The ring's schedule depends on the rank
(causal attention in the plain layout: the rank holding the first chunk reads no other rank's
K/V; under masks, a rank may need none of the blocks it is sent), so its graphs differ by rank.

The partitioner may also move a collective between the forward and backward graphs on one rank
only: a backward collective whose input is known in the forward (a rank that computed nothing
sends back zeros) is hoisted into that rank's forward, and a backward K/V rotation is merged with
the forward's (the whole sequence's K/V then saved for the backward).

`Uses.keep` folds one element of each received buffer into a float32 scalar, and `Uses.tie`
adds a zero made from that scalar to what the rank returns (out in the forward, dq in the
backward): every collective the rank issued feeds its result, so no pass can remove it on one
rank only. `anchored` adds a zero made from a backward input (the output's gradient) to what a
backward collective sends, so it cannot run before the backward. Values are unchanged bit for bit
(x - 0.0, -0.0 kept; NaN and inf are cleaned first). Inductor keeps collectives in issue order (its comm
passes never reorder them relative to each other), so every rank runs them in the same order.
"""
from __future__ import annotations

import torch


def _zero_from(t: torch.Tensor) -> torch.Tensor:
    """+0.0 (never -0.0, never NaN), computed from t's first element. Inductor folds only an integer
    multiplication by 0, so this float one stays a dependence."""
    one = t.reshape(-1)[:1].float()
    return torch.nan_to_num(one.abs() * 0.0, nan=0.0, posinf=0.0, neginf=0.0)


def anchored(x: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """x, equal bit for bit, now computed from `on` (a backward input, e.g. the output's gradient).
    x - (+0.0) is x for every x, -0.0 included (x + 0.0 would turn -0.0 into +0.0)."""
    return x - _zero_from(on).to(x.dtype) if on.numel() else x


class Uses:
    """The received buffers of one ring call on one rank, folded into a scalar."""

    def __init__(self):
        self.token = None

    def keep(self, received: torch.Tensor) -> torch.Tensor:
        """Record a use of `received` (a collective's waited result); returns it unchanged."""
        if received.numel():
            one = received.reshape(-1)[:1].float()
            self.token = one if self.token is None else self.token + one
        return received

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        """x, equal bit for bit, now computed from every kept buffer."""
        if self.token is None:
            return x
        return x - _zero_from(self.token).to(x.dtype)
