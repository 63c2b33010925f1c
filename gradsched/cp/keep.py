"""Every collective a rank issues has a use on that rank, so no compiler can drop it there.

AOTAutograd treats functional collectives as pure ops: one whose result a rank's graph never
reads is dead code there, removed (or moved into the backward by the partitioner), while its
peers, whose graphs do read it, wait for it forever. The ring's schedule depends on the rank
(causal attention in the plain layout: the rank holding the first chunk reads no other rank's
K/V; under masks, a rank may need none of the blocks it is sent), so its graphs differ by rank.

`Uses.keep` folds one element of each received buffer into a float32 scalar, and `Uses.tie`
adds a zero made from that scalar to what the rank returns (out in the forward, dq in the
backward). The value is unchanged bit for bit (x + 0.0; NaN and inf from the received data are
cleaned first), and every collective the rank issued now feeds its result: no pass can remove
it on one rank only. Inductor keeps collectives in issue order (its comm passes never reorder
them relative to each other), so every rank runs them in the same order.
"""
from __future__ import annotations

import torch


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
        zero = torch.nan_to_num(self.token * 0.0, nan=0.0, posinf=0.0, neginf=0.0)
        return x + zero.to(x.dtype)
