"""A plan's memory per pipeline stage, as stacked bars against the device's memory (matplotlib)."""
from __future__ import annotations

import textwrap

PARTS = (("params", "parameters"), ("grads", "gradients"), ("masters", "fp32 masters"),
         ("optimizer", "optimizer state"), ("activations", "activations, scratch and runtime buffers (the rest of the peak)"))


def plot_roles(roles: list, path: str, device_bytes: int | None, title: str) -> None:
    """Write a PNG: one bar per stage, its parts stacked to its predicted peak, and the device's memory line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot draws with matplotlib: pip install matplotlib (or gradsched[bench]).") from e
    gib = 2 ** 30
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(roles) + 2), 4.5))
    stages = [f"stage {r.stage}\n(ranks {r.ranks})" for r in roles]
    bottom = [0.0] * len(roles)
    for key, label in PARTS:
        values = [(r.peak - r.params - r.grads - r.masters - r.optimizer if key == "activations" else getattr(r, key))
                  / gib for r in roles]
        ax.bar(stages, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    if device_bytes:
        ax.axhline(device_bytes / gib, color="black", linestyle="--", label=f"device memory ({device_bytes / gib:.3g} GiB)")
    ax.set_ylabel("GiB per rank")
    ax.set_title(textwrap.fill(title, 60), fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
