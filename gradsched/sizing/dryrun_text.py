"""What the dry run prints: sizes, and a role's lines."""
from __future__ import annotations


def parse_bytes(text: str) -> int:
    units = {"gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6}
    t = text.strip().lower()
    unit = next((u for u in units if t.endswith(u)), None)
    return int(float(t[:-len(unit)] if unit else t) * (units[unit] if unit else 1))


def count(n: int) -> str:
    """2.87M, 8.03B: a parameter count in three significant digits."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe(r) -> str:  # r: a gradsched.sizing.roles.Role
    gib = size
    who = (f"pipeline rank {r.stage}, stages {' and '.join(map(str, r.stages))}" if getattr(r, "stages", None)
           else f"stage {r.stage}")
    lines = [f"{who} (ranks {r.ranks}): peak {gib(r.peak)}; parameters {gib(r.params)}, gradients "
             f"{gib(r.grads)}, masters {gib(r.masters)}, optimizer state {gib(r.optimizer)}"]
    lines += [f"    {k}: {gib(v)} per step" for k, v in {**r.collectives, **r.p2p}.items()]
    lines.append(f"    verifier: {r.verdict}")
    return "\n".join(lines)
