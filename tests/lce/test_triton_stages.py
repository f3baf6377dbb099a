"""Stage-level tests of the Triton kernels against float64 torch math of the same stage.

Three actors per check: the float64 reference on the same rounded inputs (R), the kernel (K), and
for gradients the baseline B = the same float64 math with d_logits rounded to the input dtype, the
one rounding every tensor-core path makes. Runs compiled on CUDA, else under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields, replace
from typing import NamedTuple

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the import of the kernels: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from lce.backends import gemm
from lce.backends.base import BackwardRows, ShardStats, Wanted
from lce.backends.triton import TileShape, TritonConfig, TritonStages, forward_kernel
from lce.backends.triton import stages as stages_module
from lce.backends.triton.config import GPU_CONFIG
from lce.options import LogitOptions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def small_config(**changes) -> TritonConfig:
    """Tiles small enough that the test shapes span several tiles, splits and chunks."""
    tile = TileShape(block_t=32, block_v=64, block_h=32, group=2, num_warps=4, num_stages=2)
    defaults = {"forward": tile, "backward": tile, "tiles_per_program": 2, "chunk_bytes": 1 << 20}
    return TritonConfig(**{**defaults, **changes})


# (T, H, V_local, vocab_start, temperature): V not a multiple of the tile, V smaller than a tile,
# T = 1, H not a multiple of 16 (37: rows not 16-byte aligned, so pointer loads instead of TMA),
# a shard starting at 1000 (targets outside it), temperature != 1.
SHAPES = [
    (37, 80, 300, 0, 1.0),
    (1, 37, 50, 0, 1.0),
    (20, 24, 129, 1000, 0.7),
]


def make_case(num_tokens, hidden_size, vocab, vocab_start, dtype, seed, spread=1.0, offset=0.0):
    """Gaussian hidden/weight with a heavy-tailed weight row scale (uniform weights hide bugs).

    ``offset`` is added to every logit through the last hidden column; targets cover the shard,
    other shards, and ignored rows (-1).
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64) * spread
    row_scale = torch.exp(torch.randn(vocab, 1, generator=gen, dtype=torch.float64))
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * row_scale * 0.3
    if offset:
        hidden[:, -1], weight[:, -1] = offset / 8.0, 8.0  # exact in every dtype for offset 1e4
    targets = torch.randint(
        vocab_start - 20, vocab_start + vocab + 20, (num_tokens,), generator=gen
    )
    targets[::5] = -1
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE), targets.to(DEVICE)


def reference_logits(hidden, weight, temperature):
    return (hidden.double() @ weight.double().T) / temperature


class RefStats(NamedTuple):
    """float64 ``[T]`` statistics of one shard; ``others = sum_{j != y} exp(z_j - max)``,
    ``nonmax`` the same sum over every lane but one max lane."""

    max: torch.Tensor
    lse: torch.Tensor
    expected: torch.Tensor  # E_p[z]
    target: torch.Tensor  # z_y where the shard owns y, else 0
    others: torch.Tensor
    nonmax: torch.Tensor
    owned: torch.Tensor


def reference_stats(hidden, weight, targets, vocab_start, temperature) -> RefStats:
    z = reference_logits(hidden, weight, temperature)
    row_max = z.amax(dim=1)
    e = torch.exp(z - row_max[:, None])
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[1])
    lane = local.clamp(0, z.shape[1] - 1)[:, None]
    picked = z.gather(1, lane).squeeze(1)
    others = e.scatter(1, lane, torch.where(owned[:, None], 0.0, e.gather(1, lane))).sum(dim=1)
    nonmax = e.scatter(1, z.argmax(dim=1, keepdim=True), 0.0).sum(dim=1)
    lse = row_max + torch.log(e.sum(dim=1))
    expected = row_max + (e * (z - row_max[:, None])).sum(dim=1) / e.sum(dim=1)
    target = torch.where(owned, picked, torch.zeros_like(picked))
    return RefStats(row_max, lse, expected, target, others, nonmax, owned)


def reference_rows(hidden, weight, targets, vocab_start, temperature, upstream) -> BackwardRows:
    """The backward stage's fp32 inputs from float64 statistics (the shard as the whole vocab)."""
    ref = reference_stats(hidden, weight, targets, vocab_start, temperature)
    g_lp, g_ent = upstream
    p_target = torch.exp(ref.target - ref.lse)
    complement = ref.others / torch.exp(ref.lse - ref.max)
    target_grad = g_lp.double() * complement - g_ent.double() * p_target * (
        ref.target - ref.expected
    )
    return BackwardRows(
        (ref.max * temperature).float(),  # raw dot units, as `ShardStats.max`
        *(s.float() for s in (ref.lse - ref.max, ref.expected - ref.max)),
        g_lp,  # the softmax coefficient: the log-prob's upstream alone
        g_ent,
        torch.where(ref.owned, target_grad, 0.0).float(),
        torch.zeros_like(g_lp),  # no label smoothing
    )


def accumulation_tol(hidden, weight, temperature):
    """Worst-case fp32 error of one logit: H rounded products summed, each <= 2^-24 relative.

    max, lse, expected_logit and target_logit are 1-Lipschitz in the logits, so this bounds them
    too, plus a few fp32 roundings of the value itself (the second term).
    """
    products = hidden.double().abs() @ weight.double().abs().T / temperature
    return hidden.shape[1] * 2.0**-24 * products.max().item()


def check_stats(stats, hidden, weight, targets, vocab_start, temperature):
    ref = reference_stats(hidden, weight, targets, vocab_start, temperature)
    max_z = stats.max.double() / temperature  # max and target_logit come in raw dot units
    lse = max_z + torch.log(stats.sumexp.double())
    expected = max_z + stats.sumexp_z.double() / stats.sumexp.double()
    tol = accumulation_tol(hidden, weight, temperature)
    for name, got, want in [
        ("max", max_z, ref.max),
        ("lse", lse, ref.lse),
        ("expected_logit", expected, ref.expected),
        ("target_logit", stats.target_logit.double() / temperature, ref.target),
    ]:
        err = (got.double() - want).abs()
        bound = 2 * tol + 8 * 2.0**-24 * (1 + want.abs())
        assert bool((err <= bound).all()), f"{name}: max err {err.max():.3e}, tol {tol:.3e}"
    # nonmax is a sum of exps: the logits' error (tol, on both sides of the max) is relative in
    # it, plus one fp32 rounding per added lane; rows below 1e-30 sit in fp32's subnormal range.
    # Relative, not eps(1): that is what keeps a confident row's log p_y and 1 - p_y precise.
    nonmax = stats.sumexp_nonmax.double() * torch.exp(max_z - ref.max)
    rel_bound = math.expm1(4 * tol + weight.shape[0] * 2.0**-24)
    err = (nonmax - ref.nonmax).abs()
    assert bool((err <= rel_bound * ref.nonmax + 1e-30).all()), f"nonmax: max err {err.max():.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_stats_match_float64(shape, dtype):
    num_tokens, hidden_size, vocab, vocab_start, temperature = shape
    hidden, weight, targets = make_case(num_tokens, hidden_size, vocab, vocab_start, dtype, seed=1)
    stats = TritonStages(small_config()).forward_stats(
        hidden, weight, None, targets, vocab_start, LogitOptions(temperature=temperature)
    )
    check_stats(stats, hidden, weight, targets, vocab_start, temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_peaked_rows_and_large_offsets(dtype):
    """Spread > 88 (exp underflows for all but the max), targets at the max, offset +1e4."""
    hidden, weight, _ = make_case(24, 48, 200, 0, dtype, seed=2, spread=40.0, offset=1e4)
    targets = reference_logits(hidden, weight, 1.0).argmax(dim=1)
    stats = TritonStages(small_config()).forward_stats(
        hidden, weight, None, targets, 0, LogitOptions()
    )
    check_stats(stats, hidden, weight, targets, 0, 1.0)
    assert bool((stats.sumexp >= 1).all())  # the max term contributes exp(0) = 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_keeps_tied_max_lanes(dtype):
    """The max logit on 4 lanes (copies of one weight row): two in one tile, one in another tile
    of the same split, one in another split. sumexp_nonmax leaves exactly one of them out."""
    hidden, weight, targets = make_case(20, 16, 300, 0, dtype, seed=3)
    hidden[:, -1] = 1.0
    weight[[5, 6, 40, 250]] = weight[5].clone()
    weight[[5, 6, 40, 250], -1] = 48.0
    z = reference_logits(hidden, weight, 1.0)
    assert bool((z[:, 5] == z.amax(dim=1)).sum() >= 15)  # most rows have their max there
    stats = TritonStages(small_config()).forward_stats(
        hidden, weight, None, targets, 0, LogitOptions()
    )
    check_stats(stats, hidden, weight, targets, 0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_counts_max_lanes_on_flat_rows(dtype):
    """Flat rows (logits within ~1 of each other): every lane's exp is near 1, so the tile's two
    sums (all lanes, lanes below the max) round differently; the max-lane count taken from their
    difference must be rounded, not truncated (truncated: lse off by up to 2)."""
    hidden, weight, targets = make_case(20, 16, 300, 0, dtype, seed=4, spread=0.3)
    stats = TritonStages(small_config()).forward_stats(
        hidden, weight, None, targets, 0, LogitOptions()
    )
    check_stats(stats, hidden, weight, targets, 0, 1.0)


def test_tf32_option_stays_within_tf32_rounding():
    hidden, weight, targets = make_case(24, 64, 150, 0, torch.float32, seed=10)
    stats = TritonStages(small_config(fp32_precision="tf32")).forward_stats(
        hidden, weight, None, targets, 0, LogitOptions()
    )
    ref_lse = reference_stats(hidden, weight, targets, 0, 1.0).lse
    lse = stats.max.double() + torch.log(stats.sumexp.double())
    # TF32 rounds both operands to 10 mantissa bits: each product within 2^-10 relative, and lse
    # is 1-Lipschitz in the logits, so 2^-10 of the largest |h| @ |w| row sum bounds the error.
    products = hidden.double().abs() @ weight.double().abs().T
    assert (lse - ref_lse).abs().max().item() <= 2.0**-10 * products.max().item()


def reference_grads(hidden, weight, targets, vocab_start, temperature, upstream, round_to=None):
    """float64 (grad_hidden, grad_weight); ``round_to`` rounds d_logits first (the baseline)."""
    z = reference_logits(hidden, weight, temperature)
    ref = reference_stats(hidden, weight, targets, vocab_start, temperature)
    lse, expected = ref.lse, ref.expected
    g_lp, g_ent = (g.double()[:, None] for g in upstream)
    p = torch.exp(z - lse[:, None])
    local = targets - vocab_start
    onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == local[:, None]).double()
    d_logits = (g_lp * (onehot - p) - g_ent * p * (z - expected[:, None])) / temperature
    if round_to is not None:
        d_logits = d_logits.to(round_to).double()
    return d_logits @ weight.double(), d_logits.T @ hidden.double()


def strided_upstream(targets, seed, expanded_entropy):
    """Random fp32 grads: g_lp a stride-2 view, zero on ignored rows; g_ent random (zero on
    ignored rows) or one value expanded with stride 0 (then ignored rows get it too)."""
    gen = torch.Generator().manual_seed(seed)
    active = (targets != -1).cpu()
    pairs = torch.randn(targets.shape[0], 2, generator=gen)
    g_lp = (pairs * active[:, None]).to(DEVICE)[:, 0]
    if expanded_entropy:
        return g_lp, torch.full((1,), -0.7, device=DEVICE).expand(targets.shape[0])
    return g_lp, (pairs[:, 1] * active).to(DEVICE)


def run_backward(stages, hidden, weight, targets, vocab_start, temperature, upstream, **need):
    rows = reference_rows(hidden, weight, targets, vocab_start, temperature, upstream)
    wanted = Wanted(need.get("need_hidden", True), need.get("need_weight", True))
    grads = stages.backward_grads(
        hidden, weight, None, targets, vocab_start, LogitOptions(temperature=temperature), rows,
        wanted,
    )  # fmt: skip
    return grads.hidden, grads.weight


# Floor of the gradient check: relative fp32 error of recomputed logits (accumulation_tol is
# ~1e-6 of the logits here) amplified by |z - expected| <= ~10 in the entropy term; 1e-5 of ||R||.
GRAD_FLOOR = 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_grads_match_float64(shape, dtype):
    num_tokens, hidden_size, vocab, vocab_start, temperature = shape
    hidden, weight, targets = make_case(num_tokens, hidden_size, vocab, vocab_start, dtype, seed=3)
    upstream = strided_upstream(targets, seed=4, expanded_entropy=num_tokens == 20)
    # chunk_bytes of 3 tiles of columns: several chunks, the last one partial. The fp32 product
    # of grad_weight, before its rounding to weight's dtype (checked on its own below).
    chunk_bytes = num_tokens * hidden.element_size() * 64 * 3
    config = small_config(chunk_bytes=chunk_bytes, grad_weight_fp32=True)
    grad_hidden, grad_weight = run_backward(
        TritonStages(config), hidden, weight, targets, vocab_start, temperature, upstream
    )
    assert grad_hidden.dtype == grad_weight.dtype == torch.float32
    ref = reference_grads(hidden, weight, targets, vocab_start, temperature, upstream)
    base = reference_grads(hidden, weight, targets, vocab_start, temperature, upstream, dtype)
    for name, got, r, b in zip(
        ("grad_hidden", "grad_weight"), (grad_hidden, grad_weight), ref, base, strict=True
    ):
        err = (got.double() - r).norm().item()
        bound = 2 * (b - r).norm().item() + GRAD_FLOOR * r.norm().item()
        assert err <= bound, f"{name}: ||K-R|| {err:.3e} > {bound:.3e}"
    if upstream[1].stride(0) != 0:
        ignored = targets == -1
        assert bool((grad_hidden[ignored] == 0).all()), "zero upstream rows get exactly zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_dlogits_inside_grad_weight(dtype):
    """d_logits chunks 3 tiles wide in grad_weight's rows not written yet, narrowing to 1 tile,
    then a 1-tile buffer of their own; grad_hidden rounded once to ``dtype`` by the stage. Same
    bound as the fp32 test above, against a baseline rounded like the results."""
    num_tokens, hidden_size, vocab = 40, 32, 700
    hidden, weight, targets = make_case(num_tokens, hidden_size, vocab, 0, dtype, seed=12)
    upstream = strided_upstream(targets, seed=13, expanded_entropy=False)
    tile = num_tokens * hidden.element_size() * 64
    config = small_config(chunk_bytes=2 * tile, aliased_chunk_bytes=3 * tile, tail_chunk_bytes=tile)
    free = torch.empty_like(weight)
    chunks = stages_module._dlogits_chunks(num_tokens, weight, free, config)
    assert [c.start for c, _ in chunks] == [0] + [c.stop for c, _ in chunks[:-1]]
    assert chunks[-1][0].stop == vocab
    inside = [d._base is free for _, d in chunks]
    assert inside[0] and not inside[-1] and inside == sorted(inside, reverse=True)
    assert [c.stop - c.start for c, _ in chunks] == [192, 192, 128, 64, 64, 60]
    rows = reference_rows(hidden, weight, targets, 0, 1.0, upstream)
    grad_hidden, grad_weight, _ = TritonStages(config).backward_grads(
        hidden, weight, None, targets, 0, LogitOptions(), rows, Wanted(True, True), dtype
    )
    assert grad_hidden.dtype == grad_weight.dtype == dtype
    ref = reference_grads(hidden, weight, targets, 0, 1.0, upstream)
    base = reference_grads(hidden, weight, targets, 0, 1.0, upstream, dtype)
    for name, got, r, b in zip(
        ("grad_hidden", "grad_weight"), (grad_hidden, grad_weight), ref, base, strict=True
    ):
        err = (got.double() - r).norm().item()
        bound = 2 * (b.to(dtype).double() - r).norm().item() + GRAD_FLOOR * r.norm().item()
        assert err <= bound, f"{name}: ||K-R|| {err:.3e} > {bound:.3e}"


def test_dlogits_chunks_at_llama3_8k_stay_inside_grad_weight():
    """The GPU config at 8192 x 4096 x 128256 (meta tensors, no memory): every chunk but the
    last few lies in grad_weight past its own rows, the one buffer of its own is the 16 MiB tail
    (it was 128 MiB), and the narrowing adds few chunks (16 at full width)."""
    (num_tokens, hidden_size, vocab), config = (8192, 4096, 128256), GPU_CONFIG
    weight = torch.empty(vocab, hidden_size, dtype=torch.bfloat16, device="meta")
    free = torch.empty_like(weight)
    chunks = stages_module._dlogits_chunks(num_tokens, weight, free, config)
    assert [c.start for c, _ in chunks] == [0] + [c.stop for c, _ in chunks[:-1]]
    assert chunks[-1][0].stop == vocab
    own = set()
    for chunk, d_logits in chunks:
        if d_logits._base is free:
            first = d_logits.storage_offset()
            assert first >= chunk.stop * hidden_size
            assert first + num_tokens * d_logits.stride(0) <= free.numel()
        else:
            own.add(d_logits._base)
    (buffer,) = own
    assert buffer.numel() * buffer.element_size() <= config.tail_chunk_bytes
    assert len(chunks) <= 22


@pytest.mark.parametrize(
    ("shape", "rows", "fixed_rows"),
    [
        ((8192, 4096, 128256), 4096, 4096),
        ((16384, 3584, 152064), 4096, 4096),
        ((8192, 2304, 256000), 2816, 2048),
    ],
    ids=["llama3-8k", "qwen2.5-16k", "gemma2-8k"],
)
def test_loss_chunk_rows_fill_the_peak_allowance(shape, rows, fixed_rows):
    """The 3-GEMM loss's logits chunk with the GPU config: `loss_chunk_bytes` (1.25 GiB), or
    what 1.45x the gradients leaves beside the fp32 grad_hidden where that is more (gemma2-8k:
    3 chunks instead of 4); chunk and grad_hidden within 1.45x the gradients either way."""
    num_tokens, hidden_size, vocab = shape
    assert TritonStages(GPU_CONFIG).loss_chunk_rows(num_tokens, vocab, hidden_size, 2) == rows
    grads = (num_tokens + vocab) * hidden_size * 2
    assert rows * vocab * 2 + 4 * num_tokens * hidden_size <= GPU_CONFIG.loss_peak_grads * grads
    fixed = TritonStages(replace(GPU_CONFIG, loss_peak_grads=0.0))
    assert fixed.loss_chunk_rows(num_tokens, vocab, hidden_size, 2) == fixed_rows


def test_backward_need_flags_and_low_precision_grad_weight():
    hidden, weight, targets = make_case(16, 32, 100, 0, torch.bfloat16, seed=5)
    upstream = strided_upstream(targets, seed=6, expanded_entropy=False)
    stages = TritonStages(small_config())
    args = (hidden, weight, targets, 0, 1.0, upstream)
    grad_hidden, grad_weight = run_backward(stages, *args, need_hidden=False)
    assert grad_hidden is None and grad_weight.dtype == torch.bfloat16  # the default
    _, full = run_backward(TritonStages(small_config(grad_weight_fp32=True)), *args)
    assert full.dtype == torch.float32
    # One bf16 rounding of an fp32 product (cuBLAS may sum it in another order): <= 1 ulp, 2^-8.
    torch.testing.assert_close(grad_weight.float(), full, rtol=2.0**-8, atol=0.0)
    grad_hidden, grad_weight = run_backward(stages, *args, need_weight=False)
    assert grad_weight is None and grad_hidden.shape == hidden.shape


# (m, k, n): a long K with a small output (the shape cuBLAS splits over K), a ragged one, a row.
@pytest.mark.parametrize(("m", "k", "n"), [(64, 16384, 64), (300, 257, 40), (1, 2048, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_gemm_is_one_rounding(m, k, n, dtype, monkeypatch):
    """`gemm.mm_into` into fp16/bf16 = the fp32 product rounded once: split-K partial sums are not
    rounded to the output dtype (cuBLAS) and the CPU's row blocks (7 rows here) cover every row."""
    monkeypatch.setattr(gemm, "TEMP_BYTES", 4 * n * 7)
    gen = torch.Generator().manual_seed(m + k + n)
    a, b = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for shape in ((m, k), (k, n)))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    gemm.mm_into(a, b, out)
    once = (a.float() @ b.float()).to(dtype).float()
    # 1 ulp: cuBLAS sums in another order, so the one rounding may land on the other side; plus
    # the fp32 sums' own order difference, <= log2(k) * 2^-24 * |a| @ |b| (pairwise bound). Partial
    # sums rounded to bf16 are ~0.1 off here (64 x 16384 x 64): a fifth of the entries fail.
    bound = torch.finfo(dtype).eps * once.abs()
    bound += math.log2(k) * 2.0**-24 * (a.float().abs() @ b.float().abs())
    assert bool(((out.float() - once).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 2, 129, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_row_sum_rounds_once_in_its_own_memory(rows, dtype):
    """`gemm.RowSum`: products over overlapping row ranges summed in fp32 (half the rows inside
    the result's memory), then rounded in place: the fp32 sum rounded once. On CPU the same fp32
    operations run, so equal; cuBLAS may sum in another order: 1 ulp plus the fp32 order bound."""
    gen = torch.Generator().manual_seed(rows)
    total = gemm.RowSum(rows, 24, dtype, torch.device(DEVICE))
    acc = torch.zeros(rows, 24, device=DEVICE)
    scale = torch.zeros(rows, 24, device=DEVICE)
    for first in (0, rows // 3, 0, rows - 1):
        a, b = (
            torch.randn(s, generator=gen).to(DEVICE, dtype) for s in ((rows - first, 40), (40, 24))
        )
        total.add(slice(first, rows), a, b)
        gemm.addmm_(acc[first:], a, b)
        scale[first:] += a.float().abs() @ b.float().abs()
    out = total.result()
    assert out.dtype == dtype and out.shape == (rows, 24)
    once = acc.to(dtype).float()
    bound = 0 if DEVICE == "cpu" else torch.finfo(dtype).eps * once.abs() + 8 * 2.0**-24 * scale
    assert bool(((out.float() - once).abs() <= bound).all())


@pytest.mark.parametrize(("num_tokens", "vocab"), [(0, 50), (5, 0)])
def test_empty_tokens_or_shard(num_tokens, vocab):
    hidden, weight, targets = make_case(max(num_tokens, 1), 16, max(vocab, 1), 0, torch.float32, 7)
    hidden, weight, targets = hidden[:num_tokens], weight[:vocab], targets[:num_tokens]
    stages = TritonStages(small_config())
    stats = stages.forward_stats(hidden, weight, None, targets, 0, LogitOptions())
    assert stats.max.shape == (num_tokens,) and bool((stats.max == float("-inf")).all()) == (
        vocab == 0 or num_tokens == 0
    )
    rows = BackwardRows(*torch.zeros(len(fields(BackwardRows)), num_tokens, device=DEVICE))
    grad_hidden, grad_weight, _ = stages.backward_grads(
        hidden, weight, None, targets, 0, LogitOptions(), rows, Wanted(True, True)
    )
    assert not grad_hidden.any() and not grad_weight.any()
    assert grad_weight.shape == weight.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pointer_loads_match_tma_and_strided_hidden(dtype):
    """Both load paths, and a column-major hidden (pointer loads), give the same statistics."""
    hidden, weight, targets = make_case(24, 48, 150, 0, dtype, seed=8)
    transposed = hidden.T.contiguous().T  # same values, column-major strides
    tma = TritonStages(small_config()).forward_stats(
        hidden, weight, None, targets, 0, LogitOptions()
    )
    pointers = TritonStages(small_config(use_tma=False))
    tol = accumulation_tol(hidden, weight, 1.0)  # the paths may sum H in another order on GPU
    for other in (
        pointers.forward_stats(hidden, weight, None, targets, 0, LogitOptions()),
        pointers.forward_stats(transposed, weight, None, targets, 0, LogitOptions()),
    ):
        torch.testing.assert_close(other.max, tma.max, atol=tol, rtol=0)
        torch.testing.assert_close(other.target_logit, tma.target_logit, atol=tol, rtol=0)
        # sumexp is exp of the logits: relative error ~ the logits' absolute error.
        torch.testing.assert_close(other.sumexp, tma.sumexp, rtol=2 * tol + 1e-6, atol=0)


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_persistent_forward_matches_one_program_per_item(use_tma):
    """Programs walking several (token tile, split) items (warp-specialized on GPU with TMA)
    write the same partials, bit for bit, as one program per item: same tiles, same order."""
    hidden, weight, targets = make_case(100, 48, 300, 0, torch.bfloat16, seed=12)
    stats = [
        TritonStages(small_config(persistent=persistent, use_tma=use_tma)).forward_stats(
            hidden, weight, None, targets, 0, LogitOptions(temperature=0.7)
        )
        for persistent in (True, False)
    ]
    for name in ("max", "sumexp_nonmax", "sumexp_z", "target_logit"):
        assert torch.equal(getattr(stats[0], name), getattr(stats[1], name)), name


@pytest.mark.parametrize("num_splits", [7, 150])
def test_merge_partials_rescales_each_split_and_skips_unseen_ones(num_splits):
    """float64 merge of hand-made partials: split 2 saw nothing on 30 rows, rows 0-4 saw nothing;
    rows 50-59 have two splits tied at the max (one keeps its max lane's 1 out of the sum). The
    maxima are raw dots: their differences are scaled by 1/T = 1/0.7 before the exp. Each split's
    centred sum of the logits (label smoothing) moves by its column count (40; the last 17)
    times that shift. 150 splits: the merge's tiles of splits, the last one partly past the end."""
    gen = torch.Generator().manual_seed(13)
    partials = torch.randn(len(forward_kernel.PARTIALS), num_splits, 100, generator=gen)
    partials[0] *= 5
    partials[0, 3, 50:60] = partials[0, :, 50:60].amax(0)
    partials[1] = partials[1].abs() + 0.1
    partials[0, 2, :30] = partials[0, :, :5] = float("-inf")
    partials[1:, 2, :30] = partials[1:, :, :5] = 0.0
    logit = LogitOptions(temperature=0.7, label_smoothing=0.1)
    vocab = (num_splits - 1) * 40 + 17
    out = torch.full((len(fields(ShardStats)), 100), 7.0, device=DEVICE)
    forward_kernel.merge_partials(partials.to(DEVICE), logit, vocab, 40, out)
    got = ShardStats(*out.unbind(0))
    split_max, nonmax, sumexp_z, sum_centred = partials.double().unbind(0)
    row_max = split_max.amax(0)
    seen = split_max > float("-inf")
    shift = torch.where(seen, (split_max - row_max.clamp(min=-1e300)) / 0.7, 0.0)
    scale = torch.where(seen, shift.exp(), 0.0)
    sumexp = torch.where(seen, 1 + nonmax, 0.0)
    columns = torch.tensor([40.0] * (num_splits - 1) + [17.0], dtype=torch.float64)[:, None]
    expected = {
        "max": row_max,
        "sumexp_nonmax": (scale * sumexp).sum(0) - 1,
        "sumexp_z": (scale * (sumexp_z + shift * sumexp)).sum(0),
        "target_logit": torch.full((100,), 7.0, dtype=torch.float64),  # left to target_kernel
        "sum_centred": torch.where(seen, sum_centred + columns * shift, 0.0).sum(0),
    }
    for name, want in expected.items():
        # fp32 sums of <= 150 terms of magnitude <= ~50 (the centred sums ~2000): each within
        # 150 ulps (9e-6 relative) of the float64 sum, the bound of any order of adding them.
        atol = 1e-5 * max(50.0, want.abs().max().item())
        torch.testing.assert_close(getattr(got, name).double().cpu(), want, rtol=1e-5, atol=atol)
    assert bool((got.max[:5] == float("-inf")).all()) and not got.sumexp[:5].any()


def test_bad_operands_raise_clear_errors():
    hidden, weight, targets = make_case(4, 16, 20, 0, torch.float32, seed=9)
    stages = TritonStages(small_config())
    with pytest.raises(ValueError, match="hidden"):
        stages.forward_stats(hidden.half(), weight, None, targets, 0, LogitOptions())
    with pytest.raises(ValueError, match="targets"):
        stages.forward_stats(hidden, weight, None, targets.int(), 0, LogitOptions())
    with pytest.raises(ValueError, match="block_v"):
        TileShape(block_t=32, block_v=48, block_h=32)
    with pytest.raises(ValueError, match="fp32_precision"):
        small_config(fp32_precision="fast")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_centres_lanes_as_the_forward_did(backend):
    """Under a common offset (here 300 / 0.7 in z) the gradient along the offset is exactly 0:
    the d_logits of a row sum to 0 when the backward's p are those of the forward's log-sum-exp.

    Hidden column 0 is the offset and weight column 0 all ones, so grad_hidden[:, 0] is the row's
    sum of d_logits. Scaling lanes by 1/T before centring them on the rounded max z (the Triton
    backward did, while its forward centred raw dots) put ~2^-24 |z| = 3e-5 into each p.
    """
    import lce

    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 16, generator=gen)
    weight = torch.randn(50, 16, generator=gen)
    hidden[:, 0], weight[:, 0] = 300.0, 1.0
    targets = torch.randint(0, 50, (6,), generator=gen)
    hidden, weight = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE)
    out = lce.token_logprobs(hidden, weight, targets.to(DEVICE), temperature=0.7, backend=backend)
    upstream = torch.randn(2, 6, generator=gen).to(DEVICE)
    (out.logprobs * upstream[0] + out.entropy * upstream[1]).sum().backward()
    along_offset = hidden.grad[:, 0].abs().max().item()
    # Exactly 0 in exact math; left: p's and the GEMM's roundings, a few 2^-24 of the gradient's
    # size (measured 2.2e-7 = 0.6 of 2^-24 * 6.6 on Triton; 3.4e-5 before the fix).
    assert along_offset <= 8 * 2.0**-24 * hidden.grad[:, 1:].abs().max().item(), along_offset


def test_capped_backward_tile_changes_only_the_tile():
    """A softcap runs the backward on `TritonConfig.backward_capped` (narrower: the cap's slope
    needs registers of its own); each d_logits element is the same dot over H in the same
    block_h steps whatever the tile's width, so the grads are the plain tile's, bit for bit in
    the interpreter (on a GPU, within the dots' accumulation order)."""
    hidden, weight, targets = make_case(37, 80, 300, 0, torch.bfloat16, seed=21)
    upstream = strided_upstream(targets, seed=22, expanded_entropy=False)
    options = LogitOptions(softcap=2.0, temperature=0.8)
    rows = reference_rows(hidden, weight, targets, 0, 0.8, upstream)
    narrow = TileShape(block_t=32, block_v=32, block_h=32, group=2, num_warps=4, num_stages=2)
    grads = [
        TritonStages(small_config(**changes)).backward_grads(
            hidden, weight, None, targets, 0, options, rows, Wanted(True, True)
        )
        for changes in ({}, {"backward_capped": narrow})
    ]
    tol = 0.0 if DEVICE == "cpu" else accumulation_tol(hidden, weight, 1.0)
    assert grads[0].hidden.abs().amax() > 0 and grads[0].weight.abs().amax() > 0
    for name in ("hidden", "weight"):
        wide, capped = getattr(grads[0], name), getattr(grads[1], name)
        torch.testing.assert_close(capped.float(), wide.float(), atol=tol, rtol=0)


def test_capped_backward_tile_must_divide_the_chunk_tile():
    """The chunks are sized in the plain tile's columns; a capped tile that does not divide
    them is refused by name."""
    wide = TileShape(block_t=32, block_v=64, block_h=32)
    with pytest.raises(ValueError, match=r"backward_capped\.block_v"):
        TritonConfig(forward=wide, backward=wide, backward_capped=TileShape(32, 128, 32))
    assert TritonConfig(forward=wide, backward=wide).backward_tile(softcap=True) is wide
