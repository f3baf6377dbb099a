"""float64 ``exp``, ``log`` and ``log1p`` from IEEE basic operations: the same bits everywhere.

torch's float64 ``exp``/``log`` come from whatever vectorized library the build links, and they are
not correctly rounded: the same input gave ``exp`` results one ulp apart under torch 2.11 on an
AVX-512 host and torch 2.13 on an AVX2 one, so a failure artifact's reference did not replay bit
for bit. Here every step is an addition, multiplication, division, rounding to an integer or an
exponent split, each exactly specified by IEEE 754, applied as separate tensor ops (no FMA): the
result is at most a few ulp from the true value and identical everywhere.
"""

from __future__ import annotations

import math

import torch

# ln 2 split so that k * LN2_HI is exact for |k| < 2^20 (its low 32 bits are zero; fdlibm's).
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
# Taylor coefficients 1/n! up to n = 13: |r| <= ln2 / 2 leaves a remainder below 2^-57.
_EXP_COEFFS = tuple(1.0 / math.factorial(n) for n in range(14))
# log(m) = 2 atanh(s) = 2 (s + s^3/3 + ...), s = (m - 1)/(m + 1), |s| <= 0.172: 12 terms < 2^-60.
_ATANH_COEFFS = tuple(1.0 / (2 * n + 1) for n in range(12))
# log1p's series branch: |x| < sqrt(2) - 1 keeps s = x / (2 + x) within the series' |s| <= 0.172.
_LOG1P_SERIES = math.sqrt(2.0) - 1.0
# exp underflows to 0 below about -745.13 and overflows above about 709.78.
_EXP_MIN, _EXP_MAX = -746.0, 710.0


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0 ** k for integer-valued float64 ``k`` in [-1022, 1023], built from its exponent bits."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _horner(x: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """sum_n coeffs[n] * x**n, highest power first, one multiply and one add per step."""
    acc = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e ** x`` of a float64 tensor; exp(0) = 1 and exp(-inf) = 0 exactly, NaN stays NaN."""
    clamped = x.clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(clamped * INV_LN2)
    r = (clamped - k * LN2_HI) - k * LN2_LO
    half = torch.trunc(k / 2)
    # Two exact power-of-two factors keep each in the normal range; the second rounds once.
    value = _horner(r, _EXP_COEFFS) * _pow2(half) * _pow2(k - half)
    value = torch.where(x < _EXP_MIN, torch.zeros_like(value), value)
    value = torch.where(x > _EXP_MAX, torch.full_like(value, math.inf), value)
    return torch.where(torch.isnan(x), x, value)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of a float64 tensor; log(1) = 0 exactly, log(0) = -inf, log(x < 0) = NaN."""
    positive = x > 0
    safe = torch.where(positive & torch.isfinite(x), x, torch.ones_like(x))
    mantissa, exponent = torch.frexp(safe)  # safe = mantissa * 2**exponent, mantissa in [0.5, 1)
    low = mantissa < math.sqrt(0.5)
    m = torch.where(low, mantissa * 2.0, mantissa)  # now in [sqrt(1/2), sqrt(2))
    e = (exponent - low.to(exponent.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)  # m - 1 is exact (Sterbenz)
    log_m = 2.0 * s * _horner(s * s, _ATANH_COEFFS)
    value = e * LN2_HI + (e * LN2_LO + log_m)
    value = torch.where(x == math.inf, x, value)
    value = torch.where(x == 0, torch.full_like(value, -math.inf), value)
    return torch.where(positive | (x == 0), value, torch.full_like(value, math.nan))


def log1p(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + x)`` of a float64 tensor without rounding ``1 + x`` first: a tiny x keeps its
    relative precision (``log(1 + 1e-20)`` is 1e-20, not 0); log1p(0) = 0, log1p(-1) = -inf.

    Near 0 it is ``2 atanh(s)`` with ``s = x / (2 + x)`` (the same series as `log`); elsewhere
    ``|log(1 + x)| >= 0.34``, so rounding ``1 + x`` costs at most a few ulp of the result.
    """
    near_zero = x.abs() < _LOG1P_SERIES
    safe = torch.where(near_zero, x, torch.zeros_like(x))
    s = safe / (safe + 2.0)
    series = 2.0 * s * _horner(s * s, _ATANH_COEFFS)
    return torch.where(near_zero, series, log(x + 1.0))


# expm1's series branch: |x| <= ln 2 / 2, where 16 Taylor terms leave a remainder below 2^-60.
_EXPM1_SERIES = LN2_HI / 2
_EXPM1_COEFFS = tuple(1.0 / math.factorial(n + 1) for n in range(16))


def expm1(x: torch.Tensor) -> torch.Tensor:
    """``e ** x - 1`` of a float64 tensor without the cancellation of ``exp(x) - 1`` near 0.

    Near 0 it is ``x * sum_n x**n / (n + 1)!``; elsewhere ``|e ** x - 1| >= 0.29``, so
    subtracting 1 from `exp` costs at most a few ulp of the result.
    """
    near_zero = x.abs() <= _EXPM1_SERIES
    safe = torch.where(near_zero, x, torch.zeros_like(x))
    return torch.where(near_zero, safe * _horner(safe, _EXPM1_COEFFS), exp(x) - 1.0)


def tanh_and_slope(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tanh(x), 1 - tanh(x)**2)`` of a float64 tensor, both to a few ulp of their own size.

    With ``m = expm1(-2|x|)``: ``tanh|x| = -m / (2 + m)`` and ``1 - tanh^2 = 4 e / (1 + e)^2``,
    ``e = 1 + m = exp(-2|x|)``: no cancellation where tanh saturates (``1 - t`` from a rounded
    ``t`` would carry an absolute error of an ulp of 1, all of a tiny slope).
    """
    m = expm1(-2.0 * x.abs())
    t = torch.where(x < 0, m / (2.0 + m), -m / (2.0 + m))
    e = exp(-2.0 * x.abs())
    return t, 4.0 * e / ((1.0 + e) * (1.0 + e))
