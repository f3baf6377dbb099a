"""Issue 3's targets, judged from one shape's rows of `kernel_gpu.py` (same-run ratios).

Pure Python over the benchmark's row dicts (``method``, ``mode``, ``ms``, ``peak_gib``,
``gx_rel``, ``gw_rel``), so the verdicts are printed and stored by every benchmark run, and
tested without a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LCE = "lce triton"
STOCK = "stock PyTorch"
GEMM = "1 bf16 GEMM"
# Both paths round d_logits and the gradients to bf16 once, so their errors against the fp32
# reference agree to ~1% (1.6573e-3 vs 1.6651e-3 at llama3-8k); above 2% lce adds error of its own.
ERROR_SLACK = 1.02


@dataclass(frozen=True)
class Verdict:
    """One target: ``measured`` against ``limit`` (same unit); ``over`` = measured / limit - 1."""

    target: str
    measured: float
    limit: float

    @property
    def met(self) -> bool:
        return self.measured <= self.limit

    @property
    def over(self) -> float:
        return self.measured / self.limit - 1.0

    def row(self) -> dict[str, object]:
        return {**asdict(self), "met": self.met, "over": self.over}


def judge(rows: list[dict], grads_gib: float) -> list[Verdict]:
    """The issue-3 verdicts of one shape; ratios use the faster of the run's GEMM timings."""

    def ms(method: str, mode: str) -> float:
        return _row(rows, method, mode)["ms"]

    gemm = min(r["ms"] for r in rows if r["method"] == GEMM and "ms" in r)
    verdicts = [
        Verdict("forward <= 1.15x one GEMM", ms(LCE, "fwd") / gemm, 1.15),
        Verdict("mean-loss fwd+bwd <= 1.25x of 3 GEMMs", ms(LCE, "mean") / (3 * gemm), 1.25),
        Verdict("per-token fwd+bwd <= 1.25x of 4 GEMMs", ms(LCE, "token") / (4 * gemm), 1.25),
        Verdict(
            "peak fwd+bwd <= 1.10x the gradients",
            max(_row(rows, LCE, mode)["peak_gib"] for mode in ("mean", "token")) / grads_gib,
            1.10,
        ),
    ]
    for mode in ("mean", "token"):
        for grad in ("gx_rel", "gw_rel"):
            ours, stock = _row(rows, LCE, mode)[grad], _row(rows, STOCK, mode)[grad]
            name = f"{grad[:2]} error ({mode}) <= stock PyTorch's (x{ERROR_SLACK})"
            verdicts.append(Verdict(name, ours / stock, ERROR_SLACK))
    return verdicts


def format_verdicts(verdicts: list[Verdict]) -> str:
    """A markdown table: target, measured (ratio), verdict with the margin."""
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for v in verdicts:
        verdict = "met" if v.met else f"missed by {100 * v.over:.0f}%"
        lines.append(f"| {v.target} | {v.measured:.2f}x (limit {v.limit:.2f}x) | {verdict} |")
    return "\n".join(lines)


def _row(rows: list[dict], method: str, mode: str) -> dict:
    for row in rows:
        if row["method"] == method and row["mode"] == mode and "error" not in row:
            return row
    raise KeyError(f"no timed row for {method!r} in mode {mode!r}")
