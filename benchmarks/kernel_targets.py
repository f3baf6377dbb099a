"""Issue 3's, issue 24's and issue 33's targets, and the two comparisons users make (RL: per-token
next to stock; SFT: the scalar loss next to the fastest peer), judged from one shape's rows of
`kernel_gpu.py` (same-run ratios).

Pure Python over the benchmark's row dicts (``method``, ``mode``, ``ms``, ``peak_gib``,
``gx_rel``, ``gw_rel``), so the verdicts are printed and stored by every benchmark run, and
tested without a GPU. ``python benchmarks/kernel_targets.py RUN.json ...`` judges stored runs
again (each against its own GEMM timings) and prints issue 33's verdicts and the users'
comparisons per shape.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

LCE = "lce triton"
STOCK = "stock PyTorch"
GEMM = "1 bf16 GEMM"
LCE_MAIN_GRAD = "lce triton, 3 GEMMs into main_grad"
LCE_FAST = "lce triton, fast (3 GEMMs)"
LCE_KEPT = "lce triton, kept logits (3 GEMMs)"
CCE_COMPILE = "CCE torch_compile"
LIGER_CUTE = "Liger CuTe (Hopper)"
LIGER_CUTE_FLCE = "Liger CuTe FLCE (Hopper)"
QUACK = "QuACK chunked"
# Both paths round d_logits and the gradients to bf16 once, so their errors against the fp32
# reference agree to ~1% (1.6573e-3 vs 1.6651e-3 at llama3-8k); above 2% lce adds error of its own.
ERROR_SLACK = 1.02
GRAD_FIELDS = ("gx_rel", "gw_rel")  # a row's grad_hidden and grad_weight errors


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


def gemms_method(gemms: int) -> str:
    """The method name of the floor row that runs ``gemms`` GEMMs in one call."""
    return GEMM if gemms == 1 else f"{gemms} bf16 GEMMs"


def gemm_ms(rows: list[dict], gemms: int = 1) -> float:
    """The floor every "x of N GEMMs" divides by: the run's row of ``gemms`` GEMMs in one call,
    timed in the same rounds as the paths. A call as long as the path it floors meets the card's
    power cap as the path does (a lone GEMM's call is shorter: at llama3-8k on an H100, four GEMMs
    in one call took 46.0 ms right after a sync, 4 x 10.7 one by one). Runs without that row
    (before December 2026) take ``gemms`` x one GEMM's time; runs before the interleaved rounds
    had two rows of one GEMM, before and after the others: the faster counts."""
    for method, times in ((gemms_method(gemms), 1), (GEMM, gemms)):
        timed = [r["ms"] for r in rows if r["method"] == method and "ms" in r]
        if timed:
            return times * min(timed)
    raise KeyError(f"no timed row for {GEMM!r} in mode 'fwd'")


def over_gemms(rows: list[dict], method: str, mode: str, gemms: int) -> float:
    """``method``'s time in ``mode`` as a multiple of ``gemms`` GEMMs (`gemm_ms`)."""
    return _row(rows, method, mode)["ms"] / gemm_ms(rows, gemms)


def judge(rows: list[dict], grads_gib: float) -> list[Verdict]:
    """The issue-3 verdicts of one shape."""
    verdicts = [
        Verdict("forward <= 1.15x one GEMM", over_gemms(rows, LCE, "fwd", 1), 1.15),
        Verdict("mean-loss fwd+bwd <= 1.25x of 3 GEMMs", over_gemms(rows, LCE, "mean", 3), 1.25),
        Verdict("per-token fwd+bwd <= 1.25x of 4 GEMMs", over_gemms(rows, LCE, "token", 4), 1.25),
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


def judge_issue24(
    rows: list[dict], grads_gib: float, unavailable: dict[str, str] | None = None
) -> tuple[list[Verdict], dict[str, str]]:
    """Issue 24's verdicts of one shape, and the targets not judged with the reason (a row the
    run lacks: a path that raised, or a peer that did not import, whose import error
    ``unavailable`` maps from its method name)."""
    judged = _Judged(rows, unavailable or {})
    add = judged.add

    def ratio(method: str, peer: str, field: str = "ms") -> float:
        return _row(rows, method, "mean")[field] / _row(rows, peer, "mean")[field]

    for name, method in (("3-GEMM path", LCE_MAIN_GRAD), ("fast mode", LCE_FAST)):
        add(f"{name} <= 1.10x of 3 GEMMs", lambda m=method: (over_gemms(rows, m, "mean", 3), 1.10))
        add(f"{name} faster than CCE torch_compile", lambda m=method: (ratio(m, CCE_COMPILE), 1.0))
        if method == LCE_MAIN_GRAD:
            peak_name = f"{name} peak (main_grad not counted) <= 1.5x the gradients"
            add(peak_name, lambda m=method: (_row(rows, m, "mean")["peak_gib"] / grads_gib, 1.5))
        else:
            peak_name = f"{name} peak <= CCE torch_compile's"
            add(peak_name, lambda m=method: (ratio(m, CCE_COMPILE, "peak_gib"), 1.0))
        for grad in ("gx_rel", "gw_rel"):
            add(
                f"{name} {grad[:2]} error <= stock PyTorch's (x{ERROR_SLACK})",
                lambda m=method, g=grad: (ratio(m, STOCK, g), ERROR_SLACK),
            )
    add("default path <= 1.10x of 4 GEMMs", lambda: (over_gemms(rows, LCE, "mean", 4), 1.10))
    add(
        "default path peak <= 1.10x the gradients",
        lambda: (max(_row(rows, LCE, m)["peak_gib"] for m in ("mean", "token")) / grads_gib, 1.1),
    )
    for grad in ("gx_rel", "gw_rel"):
        add(
            f"default path {grad[:2]} error <= stock PyTorch's (x{ERROR_SLACK})",
            lambda g=grad: (ratio(LCE, STOCK, g), ERROR_SLACK),
        )

    def per_token(field: str) -> float:
        return _row(rows, LCE, "token")[field] / _row(rows, LIGER_CUTE, "token")[field]

    add("per-token path faster than Liger's Hopper CuTe kernel", lambda: (per_token("ms"), 1.0))
    for grad in ("gx_rel", "gw_rel"):
        add(f"per-token {grad[:2]} error <= Liger CuTe's", lambda g=grad: (per_token(g), 1.0))
    return judged.verdicts, judged.skipped


def judge_issue33(
    rows: list[dict],
    grads_gib: float,
    unavailable: dict[str, str] | None = None,
    kept_gib: float | None = None,
) -> tuple[list[Verdict], dict[str, str]]:
    """Issue 33's verdicts of one shape and the targets not judged with the reason (as
    `judge_issue24`). Scalar loss (``grad_weight_into``, ``fast``): <= 1.06x of 3 GEMMs, faster
    than CCE torch_compile, Liger's Hopper CuTe loss and QuACK. Per-token outputs and the
    default mean loss: <= 1.08x of 4 GEMMs, faster than Liger's per-token CuTe op and the stock
    path, peak <= 1.15x the gradients. Forward <= 1.05x one GEMM. Kept logits (per-token and
    mean): the scalar loss's targets, its peak within 1.5x the gradients plus the logits the
    caller let it keep (``kept_gib``). Errors no larger than the stock path's everywhere."""
    judged = _Judged(rows, unavailable or {})
    judged.add("forward <= 1.05x one GEMM", lambda: (over_gemms(rows, LCE, "fwd", 1), 1.05))
    scalar = [("grad_weight_into", LCE_MAIN_GRAD, "mean"), ("fast", LCE_FAST, "mean")]
    for name, method, mode in scalar:
        judged.speed(name, method, mode, (3, 1.06), SCALAR_PEERS)
        if method != LCE_FAST:  # fast keeps an fp32 [V, H] buffer of its own (issue 24's target)
            judged.peak(name, method, mode, grads_gib, 1.5)
        judged.errors(name, method, mode)
    for name, mode in (("per-token", "token"), ("default mean", "mean")):
        judged.speed(name, LCE, mode, (4, 1.08), (LIGER_CUTE, STOCK))
        judged.peak(name, LCE, mode, grads_gib, 1.15)
        judged.errors(name, LCE, mode)
    for name, mode in (("kept logits, per-token", "token"), ("kept logits, mean", "mean")):
        judged.speed(name, LCE_KEPT, mode, (3, 1.06), PEERS)
        if kept_gib is not None:
            judged.peak(name, LCE_KEPT, mode, grads_gib, round(1.5 + kept_gib / grads_gib, 2))
        judged.errors(name, LCE_KEPT, mode)
    return judged.verdicts, judged.skipped


# The peers the scalar loss is held to; every peer the benchmark times (the kept logits are held
# to all); lce's scalar-loss paths.
SCALAR_PEERS = (CCE_COMPILE, LIGER_CUTE_FLCE, QUACK)
PEERS = (*SCALAR_PEERS, LIGER_CUTE, STOCK)
LCE_SCALAR = (LCE_MAIN_GRAD, LCE_FAST, LCE_KEPT, LCE)


def into_main_grad(peer: str) -> str:
    """The row of ``peer``'s mean loss with its bf16 grad_weight then added to an fp32 main_grad
    (what Megatron's gradient hook does for a layer that does not add it itself)."""
    return f"{peer} + main_grad add"


def judge_user_comparisons(
    rows: list[dict], unavailable: dict[str, str] | None = None
) -> tuple[list[Verdict], dict[str, str]]:
    """The two comparisons users make, each won when lce's time is at most the other's: RL
    users put lce's per-token path at the memory it promises (the default) next to the stock
    materialized path; SFT users the scalar loss next to the fastest peer's, lce's at the memory
    it promises (``grad_weight_into``) and, beside it, lce's fastest path whatever its memory.
    A Megatron user's gradient ends in an fp32 main_grad, which ``grad_weight_into`` adds to and
    a peer's bf16 gradient is added to after: that like-for-like comparison is the third."""
    judged = _Judged(rows, unavailable or {})
    judged.add(
        "RL: per-token, lce's default path vs stock PyTorch",
        lambda: (judged.ratio(LCE, STOCK, "token", "ms"), 1.0),
    )
    peer = _fastest(rows, PEERS)
    if peer is None:
        judged.skipped["SFT: scalar loss vs the fastest peer"] = "no peer's mean-loss row"
        return judged.verdicts, judged.skipped
    named = peer + _error_note(rows, peer)
    judged.add(
        f"SFT: scalar loss, lce's grad_weight_into vs the fastest peer ({named})",
        lambda: (judged.ratio(LCE_MAIN_GRAD, peer, "mean", "ms"), 1.0),
    )
    ours = _fastest(rows, LCE_SCALAR)
    if ours is not None:
        judged.add(
            f"SFT: scalar loss, lce's fastest path ({ours}) vs the fastest peer ({named})",
            lambda: (judged.ratio(ours, peer, "mean", "ms"), 1.0),
        )
    into = _fastest(rows, tuple(into_main_grad(name) for name in SCALAR_PEERS))
    if into is not None:
        judged.add(
            "SFT, gradient in an fp32 main_grad: lce's grad_weight_into vs the fastest "
            f"({into}{_error_note(rows, into)})",
            lambda: (judged.ratio(LCE_MAIN_GRAD, into, "mean", "ms"), 1.0),
        )
    return judged.verdicts, judged.skipped


def _error_note(rows: list[dict], peer: str) -> str:
    """Said of a peer whose mean-loss gradient errors pass stock's by more than `ERROR_SLACK`
    (the bar lce's own rows are held to): users pick the fastest, so its lost accuracy is named
    next to its time, not left out of the comparison."""
    try:
        ratios = [_row(rows, peer, "mean")[g] / _row(rows, STOCK, "mean")[g] for g in GRAD_FIELDS]
    except KeyError:  # errors not measured (a row without them, or no stock row)
        return ""
    if max(ratios) <= ERROR_SLACK:
        return ""
    return "; its gx / gw errors " + " / ".join(f"{r:.2f}x" for r in ratios) + " stock's"


def _fastest(rows: list[dict], methods: tuple[str, ...]) -> str | None:
    """Which of ``methods`` has the fastest timed mean-loss row (None: none has one)."""
    timed = [r for r in rows if r["method"] in methods and r["mode"] == "mean" and "ms" in r]
    return min(timed, key=lambda r: r["ms"])["method"] if timed else None


class _Judged:
    """Verdicts of one shape's rows; a target whose rows are missing goes to ``skipped`` with
    the reason (a peer's import error from ``unavailable``, else the missing row)."""

    def __init__(self, rows: list[dict], unavailable: dict[str, str]) -> None:
        self.rows, self.unavailable = rows, unavailable
        self.verdicts: list[Verdict] = []
        self.skipped: dict[str, str] = {}

    def add(self, target: str, measure) -> None:
        try:
            self.verdicts.append(Verdict(target, *measure()))
        except KeyError as exc:
            missing = exc.args[0]
            why = [f"{peer} unavailable: {error}" for peer, error in self.unavailable.items()
                   if repr(peer) in missing]  # fmt: skip
            why += [f"{row['method']} raised {row['error']}" for row in self.rows if "error" in row
                    and f"{row['method']!r} in mode {row['mode']!r}" in missing]  # fmt: skip
            self.skipped[target] = why[0] if why else f"no row: {missing}"

    def ratio(self, method: str, peer: str, mode: str, field: str) -> float:
        peer_mode = mode if peer not in MEAN_ONLY else "mean"
        return _row(self.rows, method, mode)[field] / _row(self.rows, peer, peer_mode)[field]

    def speed(self, name: str, method: str, mode: str, floor, peers: tuple[str, ...]) -> None:
        """``floor`` = (GEMMs, limit as a multiple of those GEMMs)."""
        gemms, limit = floor
        self.add(
            f"{name} <= {limit:.2f}x of {gemms} GEMMs",
            lambda: (over_gemms(self.rows, method, mode, gemms), limit),
        )
        for peer in peers:
            ratio = functools.partial(self.ratio, method, peer, mode, "ms")
            self.add(f"{name} faster than {peer}", lambda r=ratio: (r(), 1.0))

    def peak(self, name, method, mode, grads_gib, limit) -> None:
        self.add(
            f"{name} peak <= {limit}x the gradients",
            lambda: (_row(self.rows, method, mode)["peak_gib"] / grads_gib, limit),
        )

    def errors(self, name, method, mode) -> None:
        for grad in GRAD_FIELDS:
            self.add(
                f"{name} {grad[:2]} error <= stock PyTorch's (x{ERROR_SLACK})",
                lambda g=grad: (self.ratio(method, STOCK, mode, g), ERROR_SLACK),
            )


# Peers measured on the mean loss only (their kernels return no per-token outputs).
MEAN_ONLY = frozenset({LIGER_CUTE_FLCE, QUACK})


def kept_logits_gib(tokens_hidden_vocab: tuple[int, int, int]) -> float:
    """The bf16 ``[T, V]`` logits a kept-logits run keeps, in GiB."""
    tokens, _, vocab = tokens_hidden_vocab
    return tokens * vocab * 2 / (1 << 30)


def format_verdicts(verdicts: list[Verdict], skipped: dict[str, str] | None = None) -> str:
    """A markdown table: target, measured (ratio), verdict with the margin; then what was not
    judged and why."""
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for v in verdicts:
        verdict = "met" if v.met else f"missed by {100 * v.over:.0f}%"
        lines.append(f"| {v.target} | {v.measured:.2f}x (limit {v.limit:.2f}x) | {verdict} |")
    for target, reason in (skipped or {}).items():
        lines.append(f"| {target} | | not judged ({reason}) |")
    return "\n".join(lines)


def _row(rows: list[dict], method: str, mode: str) -> dict:
    for row in rows:
        if row["method"] == method and row["mode"] == mode and "error" not in row:
            return row
    raise KeyError(f"no timed row for {method!r} in mode {mode!r}")


# The tables `issue33_sections` judges, by the key a run's JSON stores each under.
SECTION_TITLES = {"issue33_targets": "issue-33 targets", "user_comparisons": "what users compare"}


def issue33_sections(
    shape: dict, unavailable: dict[str, str]
) -> dict[str, tuple[list[Verdict], dict[str, str]]]:
    """Issue 33's verdicts and the users' comparisons of one shape of a `kernel_gpu.py` run (its
    ``rows``, ``grads_gib`` and ``T_H_V``), keyed as in `SECTION_TITLES`."""
    rows = shape["rows"]
    kept_gib = kept_logits_gib(shape["T_H_V"])
    return {
        "issue33_targets": judge_issue33(rows, shape["grads_gib"], unavailable, kept_gib=kept_gib),
        "user_comparisons": judge_user_comparisons(rows, unavailable),
    }


def main(paths: list[str]) -> None:
    """Issue 33's verdicts and the users' comparisons of each shape of each stored
    `kernel_gpu.py` run, as markdown."""
    for path in paths:
        run = json.loads(Path(path).read_text())
        for shape in run["shapes"]:
            sections = issue33_sections(shape, run.get("peers_unavailable", {}))
            for key, (verdicts, skipped) in sections.items():
                print(f"\n## {SECTION_TITLES[key]} at {shape['shape']} ({path})")
                print(format_verdicts(verdicts, skipped))


if __name__ == "__main__":
    main(sys.argv[1:])
