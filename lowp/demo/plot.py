"""Loss-curve PNG for the demo (matplotlib, Agg backend, never shown)."""
from __future__ import annotations

from pathlib import Path

from lowp.demo.train import RunResult

__all__ = ["plot_curves"]


def plot_curves(results: list[RunResult], path: str | Path) -> None:
    """Validation loss against step for every run; raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        steps, losses = zip(*r.curve)
        ax.plot(steps, losses, label=f"{r.name} (final {r.val_loss:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte, subset)")
    ax.set_title("char-level LM on Python's stdlib: AdamW, bf16 weights by update mode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
