"""The report's picture: measured/allowed ratios per output x dtype, one panel per backend.

Every dot is one check (at most a few hundred per row; red: a failure); the diamond is the worst;
the red line at 1 is the tolerance. Zero errors sit at the left edge, failures (inf/NaN too) at
the right.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

FLOOR = 1e-4  # ratios below this (exact matches included) are drawn at the left edge
CEILING = 1e3  # inf / NaN / huge ratios are drawn at the right edge


def plot_ratios(
    ratios: dict[tuple[str, str, str], list[tuple[float, bool]]], path: Path, title: str
) -> None:
    """Write a PNG of ``ratios[(output, dtype, backend)] = [ratio, ...]`` to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({b for _, _, b in ratios}) or ["(none)"]
    rows = sorted({(o, d) for o, d, _ in ratios}, reverse=True)
    height = max(2.5, 0.32 * len(rows) + 1.6)
    fig, axes = plt.subplots(
        1, len(backends), figsize=(5.2 * len(backends) + 1.5, height), sharey=True, squeeze=False
    )
    jitter = random.Random(0)
    for ax, backend in zip(axes[0], backends, strict=True):
        for y, (output, dtype) in enumerate(rows):
            values = [_clip(r) for r in ratios.get((output, dtype, backend), [])]
            if not values:
                continue
            ys = [y + jitter.uniform(-0.25, 0.25) for _ in values]
            colors = [_color(v, "tab:blue") for v in values]
            ax.scatter(values, ys, s=9, c=colors, alpha=0.35, linewidths=0)
            worst = max(values)
            ax.scatter([worst], [y], s=46, marker="D", c=_color(worst, "black"))
        ax.axvline(1.0, color="tab:red", linestyle="--", linewidth=1.2)
        ax.axvspan(1.0, CEILING * 2, color="tab:red", alpha=0.06)
        ax.set_xscale("log")
        ax.set_xlim(FLOOR / 2, CEILING * 2)
        ax.set_title(f"backend: {backend}")
        ax.set_xlabel("measured / allowed (log; <= 1 passes)")
        ax.grid(axis="x", which="major", alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)))
    axes[0][0].set_yticklabels([f"{o}  {d}" for o, d in rows])
    axes[0][0].set_ylim(-0.6, len(rows) - 0.4)
    fig.suptitle(
        f"{title}: error ratios (dots: checks, red: failures, diamond: worst, left edge: exact)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _color(ratio: float, passing: str) -> str:
    return passing if ratio <= 1 else "tab:red"


def _clip(ratio: float) -> float:
    if math.isnan(ratio) or ratio > CEILING:
        return CEILING
    return max(ratio, FLOOR)
