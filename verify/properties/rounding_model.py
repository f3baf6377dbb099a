"""What the statistical tier needs to know of a gradient output of a case, derived from the case's
oracle: the span its errors before the output's GEMM lie in, a bound on the GEMM's own
summation error, and the roundings the case adds (`verify.numerics.compare.RoundingModel`).

The gradients are ``grad_weight = d_logits^T @ hidden`` and ``grad_hidden = d_logits @ weight``
(on the inputs as the implementation gets them, hidden cast to weight's dtype). Whatever an
implementation does before that GEMM (logits in any precision, a softmax, d_logits rounded to the
GEMM's dtype, a wrong d_logits even) changes each grad_weight row by a combination of hidden's
rows and each grad_hidden row by one of weight's rows: inside their span. What lands outside is
the GEMM's accumulation and the output's rounding(s).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from verify.cases.build import build
from verify.cases.spec import DTYPES, CaseSpec
from verify.numerics.compare import NOISE_DTYPES, RoundingModel, row_span, ulp
from verify.numerics.tolerances import Statistical, load
from verify.properties.oracle import oracle, tied

# Unit roundoff of the accumulation of 16-bit GEMMs (fp32), doubled: a GPU's tensor cores may
# round toward zero inside the dot (Fasi, Higham, Mikaitis, Pranesh 2021), up to an ulp a step.
ACCUMULATION_STEP = 2 * torch.finfo(torch.float32).eps / 2


def rounding_model(
    spec: CaseSpec, output: str, dtype: torch.dtype, tolerance: Statistical | None
) -> RoundingModel | None:
    """The model of ``output`` (``grad_hidden``, ``loss_grad_weight``, ...) of valid ``spec``,
    returned in ``dtype``; None where the tier does not apply (`applies`)."""
    if not applies(spec, output, dtype, tolerance):
        return None
    exp = oracle(spec)
    if output not in exp.magnitudes:
        return None
    weight_grad = output.endswith("grad_weight")
    # Terms summed per element: the tokens; the vocabulary, then the ranks' fp32 sum.
    inner = int(exp.problem.valid.sum()) if weight_grad else spec.vocab + spec.tp
    accumulation = inner * ACCUMULATION_STEP * exp.magnitudes[output]
    extra = None
    if not weight_grad and not spec.reduce_hidden and spec.tp > 1:
        extra = _partial_variance(spec, output.removesuffix("grad_hidden"), dtype)
    span = _spans(spec)[1 if weight_grad else 0]
    return RoundingModel(span, accumulation, extra, tolerance)


def applies(spec: CaseSpec, output: str, dtype: torch.dtype, tolerance: Statistical | None) -> bool:
    """Whether the tier judges ``output`` of ``spec`` in ``dtype``: not without ``statistical``
    tolerances, a 16-bit output, a valid case; not a per-token output, a tied weight's gradient
    (two uses' rounded gradients summed by autograd), what main_grad gained (its fp32 buffer
    rounds at the old content's scale, which the output's ulp does not bound)."""
    if tolerance is None or dtype not in NOISE_DTYPES or spec.fault != "none":
        return False
    if not output.endswith(("grad_hidden", "grad_weight")):
        return False
    gained = output == "loss_grad_weight" and spec.loss_path == "main_grad"
    return not (output.endswith("grad_weight") and (tied(spec) or gained))


# The gradients each grads choice asks for (`verify.cases.rank_inputs`).
_GRADIENTS = {"both": ("hidden", "weight"), "twice": ("hidden", "weight"),
              "hidden": ("hidden",), "weight": ("weight",), "none": ()}  # fmt: skip


def expected_dof(spec: CaseSpec) -> int:
    """The degrees of freedom the statistical tier is expected to judge on valid ``spec``'s
    16-bit gradients, summed over the outputs that reach ``min_dof`` (0: it judges none). Per
    output: its rows (the valid tokens for grad_hidden, the vocabulary for grad_weight) times the
    components outside its span (H less the rank its generators reach: the vocabulary's weight
    rows, the valid tokens' hidden rows). An estimate from the case's inputs alone, no R: rows
    that are zero and elements the accumulation's share leaves out are not subtracted.
    `verify.running.pairwise` orders its rows by it."""
    tolerance = load().statistical
    if tolerance is None or spec.fault != "none" or spec.tokens == 0:
        return 0
    valid = int(build(spec).valid.sum())
    total = 0
    for leaf in _GRADIENTS[spec.grads] if valid else ():
        dtype = DTYPES[spec.hidden_dtype if leaf == "hidden" else spec.weight_dtype]
        rows, span = (valid, spec.vocab) if leaf == "hidden" else (spec.vocab, valid)
        dof = rows * max(0, spec.hidden_size - span)
        for output in (f"grad_{leaf}", f"loss_grad_{leaf}"):
            fits = dof >= tolerance.min_dof and applies(spec, output, dtype, tolerance)
            total += dof if fits else 0
    return total


@lru_cache(maxsize=16)
def _spans(spec: CaseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden's span: weight's rows; grad_weight's: the valid tokens' hidden rows, cast
    to weight's dtype as the GEMM gets them)."""
    problem = oracle(spec).problem
    hidden = problem.hidden.to(problem.weight.dtype).to(torch.float64)[problem.valid]
    return row_span(problem.weight.to(torch.float64)), row_span(hidden)


def _partial_variance(spec: CaseSpec, prefix: str, dtype: torch.dtype) -> torch.Tensor:
    """The variance of each rank's partial grad_hidden rounded to ``dtype`` before their sum
    (sequence parallel): one rounding per rank at the partial's magnitude, bounded by its terms'
    absolute sum (a partial may exceed the whole where the ranks' shares cancel)."""
    exp = oracle(spec)
    d_logits = exp.terms[prefix].d_logits
    weight = exp.problem.weight.to(torch.float64)
    variance = torch.zeros(d_logits.shape[0], weight.shape[1], dtype=torch.float64)
    for start, stop in spec.shard_bounds():
        size = d_logits[:, start:stop].abs() @ weight[start:stop].abs()
        variance += torch.where(size > 0, ulp(size, dtype).pow(2) / 12, 0.0)
    return variance
