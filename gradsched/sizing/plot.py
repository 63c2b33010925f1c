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
    peak = max(r.peak for r in roles)
    drawn = device_bytes and peak >= device_bytes / 20  # a line 20x above every bar would flatten them
    top = max(peak, device_bytes or 0) if drawn else peak
    unit, scale = ("GiB", 2 ** 30) if top >= 2 ** 30 else ("MiB", 2 ** 20)  # a small model's bars readable
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(roles) + 2) + 3.0, 4.5))
    stages = [f"stage {r.stage}\n(ranks {r.ranks})" for r in roles]
    bottom = [0.0] * len(roles)
    for key, label in PARTS:
        values = [(r.peak - r.params - r.grads - r.masters - r.optimizer if key == "activations" else getattr(r, key))
                  / scale for r in roles]
        bars = ax.bar(stages, values, bottom=bottom, label=textwrap.fill(label, 28))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar_label(bars, [f"{b:.3g} {unit}" for b in bottom], fontsize=7)  # each stage's peak, even far below the line
    if drawn:
        ax.axhline(device_bytes / scale, color="black", linestyle="--",
                   label=f"device memory ({device_bytes / scale:.3g} {unit})")
    elif device_bytes:
        title += f"; the device's {device_bytes / 2 ** 30:.3g} GiB is {device_bytes / peak:.0f}x the largest peak"
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(textwrap.fill(title, 60), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
