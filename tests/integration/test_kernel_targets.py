"""Issue-3 verdicts from benchmark rows (benchmarks/kernel_targets.py): the llama3-8k rows of the
2026-11-23 H100 nightly (docs/results/nightly/2026-11-23-h100-persistent) give the recorded
verdicts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_targets

GRADS_GIB = (8192 + 128256) * 4096 * 2 / 2**30


def _row(method, mode, ms, peak=None, gx=None, gw=None) -> dict:
    row = {"method": method, "mode": mode, "ms": ms, "peak_gib": peak}
    return row | ({"gx_rel": gx, "gw_rel": gw} if gx is not None else {})


ROWS = [
    _row("1 bf16 GEMM", "fwd", 11.6163),
    _row("stock PyTorch", "mean", 51.7948, 11.7422, 1.66508e-3, 1.66008e-3),
    _row("stock PyTorch", "token", 51.1901, 11.7422, 2.34704e-3, 2.33725e-3),
    _row("lce triton", "fwd", 13.111, 0.0767),
    _row("lce triton", "mean", 56.7689, 1.229, 1.65730e-3, 1.65966e-3),
    _row("lce triton", "token", 55.2856, 1.2291, 2.34012e-3, 2.33698e-3),
    _row("1 bf16 GEMM", "fwd", 12.2409),  # the slower GEMM timing is not the floor
]


def test_recorded_run_meets_forward_per_token_and_errors_misses_mean_and_peak() -> None:
    verdicts = _judge(ROWS)
    assert [v.met for v in verdicts] == [True, False, True, False] + [True] * 4
    forward, mean, _, peak = verdicts[:4]
    assert forward.measured == pytest.approx(13.111 / 11.6163)
    assert mean.over == pytest.approx(56.7689 / (3 * 11.6163) / 1.25 - 1)
    assert peak.measured == pytest.approx(1.2291 / GRADS_GIB)
    table = kernel_targets.format_verdicts(verdicts)
    assert "| 1.63x (limit 1.25x) | missed by 30% |" in table


def test_errors_above_the_stock_path_fail() -> None:
    rows = [dict(r) for r in ROWS]
    rows[5]["gw_rel"] = 2.34e-3 * 1.05  # per-token grad_weight 5% worse than stock
    failed = [v.target for v in _judge(rows) if not v.met]
    assert "gw error (token) <= stock PyTorch's (x1.02)" in failed


def test_a_missing_row_names_itself() -> None:
    with pytest.raises(KeyError, match="'lce triton' in mode 'token'"):
        _judge([r for r in ROWS if not (r["method"] == "lce triton" and r["mode"] == "token")])


def test_a_floor_timed_as_one_call_of_its_gemms_counts_over_multiples_of_one() -> None:
    # Session 13's H100 numbers at llama3-8k: 4 GEMMs in one call 46.02 ms, one GEMM 10.71.
    rows = [_row("1 bf16 GEMM", "fwd", 10.71), _row("lce triton", "token", 48.35)]
    assert kernel_targets.gemm_ms(rows, 4) == pytest.approx(4 * 10.71)  # no 4-GEMM row
    rows.append(_row(kernel_targets.gemms_method(4), "fwd", 46.02))
    assert kernel_targets.gemm_ms(rows, 4) == 46.02
    assert kernel_targets.gemm_ms(rows, 1) == 10.71
    assert kernel_targets.over_gemms(rows, "lce triton", "token", 4) == pytest.approx(48.35 / 46.02)
    assert kernel_targets.gemm_ms(rows, 3) == pytest.approx(3 * 10.71)
    with pytest.raises(KeyError, match="1 bf16 GEMM"):
        kernel_targets.gemm_ms([_row("lce triton", "token", 48.35)], 3)


def _judge(rows):
    return kernel_targets.judge(rows, GRADS_GIB)


def test_issue24_targets_of_a_peer_that_did_not_import_say_why() -> None:
    import_error = "ModuleNotFoundError: No module named 'cutlass'"
    verdicts, skipped = kernel_targets.judge_issue24(
        ROWS, GRADS_GIB, {kernel_targets.LIGER_CUTE: import_error}
    )
    cute = "per-token path faster than Liger's Hopper CuTe kernel"
    assert skipped[cute] == f"{kernel_targets.LIGER_CUTE} unavailable: {import_error}"
    # A row the run lacks for another reason (a path that raised) still names the row.
    assert skipped["fast mode <= 1.10x of 3 GEMMs"].startswith("no row: no timed row for")
    judged = {v.target: v for v in verdicts}
    assert judged["default path <= 1.10x of 4 GEMMs"].measured == pytest.approx(
        56.7689 / (4 * 11.6163)
    )


# The issue-33 table's llama3-8k rows (one H100, lce at main 32c7c3e); peaks, errors and the
# per-token peers made up where the table has none.
ISSUE33_ROWS = [
    _row("1 bf16 GEMM", "fwd", 11.28),
    _row("lce triton", "fwd", 13.4, 0.08),
    _row(kernel_targets.LCE_MAIN_GRAD, "mean", 41.1, 1.10, 1.66e-3, 3.0e-5),
    _row(kernel_targets.LCE_FAST, "mean", 42.0, 3.19, 1.66e-3, 1.66e-3),
    _row(kernel_targets.CCE_COMPILE, "mean", 37.7, 2.88, 1.66e-3, 1.66e-3),
    _row(kernel_targets.LIGER_CUTE_FLCE, "mean", 44.0, 1.5, 1.66e-3, 1.7e-3),
    _row("stock PyTorch", "mean", 51.7, 11.74, 1.66e-3, 1.66e-3),
    _row("stock PyTorch", "token", 51.2, 11.74, 2.35e-3, 2.34e-3),
    _row("lce triton", "mean", 53.4, 1.12, 1.66e-3, 1.66e-3),
    _row("lce triton", "token", 54.8, 1.12, 2.35e-3, 2.34e-3),
    _row(kernel_targets.LIGER_CUTE, "token", 53.2, 1.29, 2.35e-3, 2.6e-3),
]


def test_issue33_verdicts_of_the_issue_table() -> None:
    quack_error = "ModuleNotFoundError: No module named 'quack'"
    verdicts, skipped = kernel_targets.judge_issue33(
        ISSUE33_ROWS, GRADS_GIB, {kernel_targets.QUACK: quack_error}
    )
    judged = {v.target: v for v in verdicts}
    main_grad = judged["grad_weight_into <= 1.06x of 3 GEMMs"]
    assert main_grad.measured == pytest.approx(41.1 / (3 * 11.28)) and not main_grad.met
    assert judged["grad_weight_into faster than CCE torch_compile"].over == pytest.approx(
        41.1 / 37.7 - 1
    )
    assert judged["grad_weight_into faster than Liger CuTe FLCE (Hopper)"].met
    assert skipped["fast faster than QuACK chunked"] == f"QuACK chunked unavailable: {quack_error}"
    assert not judged["forward <= 1.05x one GEMM"].met
    per_token = judged["per-token <= 1.08x of 4 GEMMs"]
    assert per_token.measured == pytest.approx(54.8 / (4 * 11.28))
    assert not judged["per-token faster than stock PyTorch"].met  # 54.8 vs 51.2 ms
    assert judged["per-token peak <= 1.15x the gradients"].met
    # A peer that imported but raised at this shape: the reason is its error.
    rows = [
        *ISSUE33_ROWS,
        {"method": kernel_targets.QUACK, "mode": "mean", "error": "ValueError: m == n"},
    ]
    _, skipped = kernel_targets.judge_issue33(rows, GRADS_GIB)
    assert skipped["fast faster than QuACK chunked"] == "QuACK chunked raised ValueError: m == n"
    # fast's peak is no issue-33 target (its fp32 buffer is issue 24's).
    assert not any(name.startswith("fast peak") for name in {**judged, **skipped})


def test_issue33_kept_logits_verdicts_take_the_scalar_loss_targets_and_the_budget() -> None:
    # The November H100 run's kept-logits rows at llama3-8k (38.2 ms per-token, 3.00 GiB).
    kept_gib = 8192 * 128256 * 2 / 2**30
    rows = [
        *ISSUE33_ROWS,
        _row(kernel_targets.LCE_KEPT, "token", 38.2, 3.00, 2.35e-3, 2.34e-3),
        _row(kernel_targets.LCE_KEPT, "mean", 38.5, 3.00, 1.66e-3, 1.66e-3),
    ]
    verdicts, skipped = kernel_targets.judge_issue33(rows, GRADS_GIB, kept_gib=kept_gib)
    judged = {v.target: v for v in verdicts}
    speed = judged["kept logits, per-token <= 1.06x of 3 GEMMs"]
    assert speed.measured == pytest.approx(38.2 / (3 * 11.28)) and not speed.met
    assert judged["kept logits, per-token faster than stock PyTorch"].met  # 38.2 vs 51.2 ms
    assert not judged["kept logits, mean faster than CCE torch_compile"].met  # 38.5 vs 37.7
    peak = judged[f"kept logits, per-token peak <= {1.5 + kept_gib / GRADS_GIB:.2f}x the gradients"]
    assert peak.limit == pytest.approx(1.5 + kept_gib / GRADS_GIB, abs=0.01)
    assert judged["kept logits, mean gx error <= stock PyTorch's (x1.02)"].met
    # Liger's CuTe FLCE is a mean-only peer: the per-token row is compared with its mean row.
    assert "kept logits, per-token faster than Liger CuTe FLCE (Hopper)" in judged
    assert not skipped.keys() & judged.keys()


def test_user_comparisons_take_the_fastest_peer_and_lces_fastest_path() -> None:
    verdicts, skipped = kernel_targets.judge_user_comparisons(ISSUE33_ROWS)
    rl, sft_promised, sft_fastest = verdicts
    assert rl.measured == pytest.approx(54.8 / 51.2) and not rl.met
    # The fastest peer's mean loss: CCE's 37.7 ms (Liger's CuTe FLCE 44.0, stock 51.7).
    assert sft_promised.target.endswith("(CCE torch_compile)")
    assert sft_promised.measured == pytest.approx(41.1 / 37.7) and not sft_promised.met
    assert f"({kernel_targets.LCE_MAIN_GRAD})" in sft_fastest.target and not skipped
    # With kept logits faster than every peer, lce's fastest path wins; the promised one not.
    rows = [*ISSUE33_ROWS, _row(kernel_targets.LCE_KEPT, "mean", 37.0, 3.0, 1.66e-3, 1.66e-3)]
    _, sft_promised, sft_fastest = kernel_targets.judge_user_comparisons(rows)[0]
    assert f"({kernel_targets.LCE_KEPT})" in sft_fastest.target and sft_fastest.met
    assert not sft_promised.met
    peerless = [r for r in ISSUE33_ROWS if r["method"] in (kernel_targets.LCE, "1 bf16 GEMM")]
    verdicts, skipped = kernel_targets.judge_user_comparisons(peerless)
    assert not verdicts and set(skipped) == {
        "RL: per-token, lce's default path vs stock PyTorch",
        "SFT: scalar loss vs the fastest peer",
    }


def test_the_fastest_peer_less_accurate_than_stock_is_named_so() -> None:
    """A peer whose gradients pass stock's errors by more than lce is allowed still sets the SFT
    bar (users pick the fastest), with its errors beside its name; an accurate one without."""
    quack = _row(kernel_targets.QUACK, "mean", 36.0, 4.1, 2.64e-3, 3.33e-3)
    verdicts, _ = kernel_targets.judge_user_comparisons([*ISSUE33_ROWS, quack])
    stock = next(r for r in ISSUE33_ROWS if r["method"] == "stock PyTorch" and r["mode"] == "mean")
    note = f"{2.64e-3 / stock['gx_rel']:.2f}x / {3.33e-3 / stock['gw_rel']:.2f}x stock's"
    assert verdicts[1].target.endswith(f"({kernel_targets.QUACK}; its gx / gw errors {note})")
    assert verdicts[1].measured == pytest.approx(41.1 / 36.0)
    accurate = kernel_targets.judge_user_comparisons(ISSUE33_ROWS)[0]
    assert accurate[1].target.endswith("(CCE torch_compile)")


def test_main_grad_comparison_adds_the_peers_main_grad_add() -> None:
    # No "+ main_grad add" row (runs before it existed): no such verdict.
    assert len(kernel_targets.judge_user_comparisons(ISSUE33_ROWS)[0]) == 3
    into = kernel_targets.into_main_grad
    rows = [
        *ISSUE33_ROWS,
        _row(into(kernel_targets.CCE_COMPILE), "mean", 39.4, 2.88, 1.66e-3, 1.66e-3),
        _row(into(kernel_targets.LIGER_CUTE_FLCE), "mean", 45.6, 1.5, 1.66e-3, 1.7e-3),
    ]
    verdicts, _ = kernel_targets.judge_user_comparisons(rows)
    like_for_like = verdicts[3]
    assert like_for_like.target.endswith(f"({into(kernel_targets.CCE_COMPILE)})")
    assert like_for_like.measured == pytest.approx(41.1 / 39.4) and not like_for_like.met
    # The strict comparison (the peer without the add) is unchanged beside it.
    assert verdicts[1].measured == pytest.approx(41.1 / 37.7)


def test_a_stored_run_is_judged_again_from_its_json(tmp_path, capsys) -> None:
    run = {"shapes": [{"shape": "llama3-8k", "T_H_V": [8192, 4096, 128256],
                       "grads_gib": GRADS_GIB, "rows": ISSUE33_ROWS}]}  # fmt: skip
    path = tmp_path / "kernel_gpu.json"
    path.write_text(json.dumps(run))
    kernel_targets.main([str(path)])
    out = capsys.readouterr().out
    assert "## issue-33 targets at llama3-8k" in out
    assert f"| grad_weight_into <= 1.06x of 3 GEMMs | {41.1 / (3 * 11.28):.2f}x" in out
    assert "## what users compare at llama3-8k" in out
