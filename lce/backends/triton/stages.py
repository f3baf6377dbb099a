"""`TritonStages`: the StageBackend of fused Triton kernels on one vocab shard.

Forward: `forward_kernel` (one pass of logits tiles, online softmax; the target lane by
`target_kernel`). Backward: per vocab chunk, `backward_kernel` recomputes logits and writes
d_logits (the target lanes placed by `target_kernel`), then two GEMMs (`lce.backends.gemm`)
accumulate grad_hidden and write grad_weight in fp32 (grad_bias: the chunk's column sums). With
``chunk_size`` both run per block of tokens. With kept logits, the forward is a cuBLAS GEMM into
them and `loss_kernels.row_stats_into`; the backward's d_logits come from them by
`loss_kernels.row_dlogits` (over them, where no backward reads them again), then each gradient
is one GEMM over the whole shard. The 3-GEMM loss (`loss_grads_in_forward`): per token
chunk, a cuBLAS logits GEMM, the row kernels of `loss_kernels`, and the two gradient GEMMs.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from lce.backends.base import BackwardRows, GlobalMerge, Grads, ShardStats, Wanted, select_rows
from lce.backends.gemm import RowSum, addmm_, mm_into
from lce.backends.triton.backward_kernel import dlogits_chunk
from lce.backends.triton.config import TritonConfig, default_config
from lce.backends.triton.forward_kernel import shard_stats
from lce.backends.triton.loss_kernels import row_dlogits, row_stats_into
from lce.backends.triton.target_kernel import target_dlogits
from lce.options import LogitOptions

# Token rows of a logits chunk are rounded to this (the GEMMs' tile multiple) when they fit.
LOSS_ROW_ALIGN = 256
# A d_logits chunk inside grad_weight starts at a multiple of this many elements (>= 128 bytes;
# TMA needs 16).
ALIAS_ALIGN = 64


def _check_operands(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and weight [V_local, H]; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) must already be cast to weight's dtype ({weight.dtype})"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [T]; got {targets.dtype} {tuple(targets.shape)}")


class TritonStages:
    """Fused Triton stages; ``config`` defaults to `default_config()` at each call.

    ``chunk_size`` (tokens per block, as on the torch backend): None runs all tokens at once; a
    number runs the kernels on blocks of that many tokens, bounding the backward's d_logits
    workspace to ``[chunk_size, width]``, with grad_weight summed over the blocks in fp32.
    """

    def __init__(self, config: TritonConfig | None = None, chunk_size: int | None = None) -> None:
        self.config = config
        self.chunk_size = chunk_size

    def _config(self) -> TritonConfig:
        return self.config if self.config is not None else default_config()

    def _token_blocks(self, num_tokens: int) -> list[slice]:
        size = self.chunk_size or max(num_tokens, 1)
        return [slice(start, min(start + size, num_tokens)) for start in range(0, num_tokens, size)]

    def forward_stats(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        kept: torch.Tensor | None = None,
    ) -> ShardStats:
        """See `lce.backends.base.StageBackend.forward_stats` (sumexp_z centred on ``max``).
        With ``kept``: the dots by cuBLAS into it, then `row_stats_into` over them."""
        _check_operands(hidden, weight, targets)
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        if num_tokens == 0 or vocab_local == 0:
            empty = torch.zeros(
                len(fields(ShardStats)), num_tokens, dtype=torch.float32, device=hidden.device
            )
            empty[0] = float("-inf")
            return ShardStats(*empty.unbind(0))
        targets, bias = targets.contiguous(), _contiguous(bias)
        if kept is not None:
            stats = torch.empty(
                len(fields(ShardStats)), num_tokens, dtype=torch.float32, device=hidden.device
            )
            mm_into(hidden, weight.T, out=kept)
            row_stats_into(kept, bias, targets, vocab_start, logit, stats)
            return ShardStats(*stats.unbind(0))
        blocks = [
            shard_stats(
                hidden[rows], weight, bias, targets[rows], vocab_start, logit, self._config()
            )
            for rows in self._token_blocks(num_tokens)
        ]
        if len(blocks) == 1:
            return blocks[0]
        return ShardStats(
            *(torch.cat([getattr(b, f.name) for b in blocks]) for f in fields(ShardStats))
        )

    def backward_grads(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        rows: BackwardRows,
        wanted: Wanted,
        grad_hidden_dtype: torch.dtype | None = None,
        kept: torch.Tensor | None = None,
        kept_writable: bool = False,
    ) -> Grads:
        """See `lce.backends.base.StageBackend.backward_grads` (grad_hidden comes back in
        ``grad_hidden_dtype`` when given). Workspace: one d_logits chunk, inside grad_weight's
        rows not written yet where they hold it (`_dlogits_chunks`), written by
        `backward_kernel` (logits recomputed); from ``kept`` logits, `_grads_from_kept`."""
        _check_operands(hidden, weight, targets)
        num_tokens, config = hidden.shape[0], self._config()
        blocks = self._token_blocks(num_tokens)
        empty = num_tokens == 0 or weight.shape[0] == 0 or not any(wanted)
        if kept is not None and not empty:
            return self._grads_from_kept(
                hidden, weight, bias, targets, vocab_start, logit, rows, wanted,
                grad_hidden_dtype, kept, kept_writable, blocks,
            )  # fmt: skip
        grad_hidden, grads = self._grad_buffers(hidden, weight, wanted, grad_hidden_dtype, blocks)
        if empty:
            return grads._replace(hidden=_result(grad_hidden))
        free_rows = grads.weight if len(blocks) == 1 and grads.weight is not None else None
        chunks = _dlogits_chunks(blocks[0].stop, weight, free_rows, config)
        rows = _scaled(rows, logit.dlogit_scale)
        targets, bias = targets.contiguous(), _contiguous(bias)
        for block in blocks:
            block_hidden = hidden[block]
            target_values = target_dlogits(
                block_hidden, weight, bias, targets[block], vocab_start, logit, config,
                rows.target_grad[block],
            )  # fmt: skip
            for chunk, buffer in chunks:
                d_logits = buffer[: block.stop - block.start]
                bias_chunk = None if bias is None else bias[chunk]
                dlogits_chunk(
                    block_hidden, weight[chunk], bias_chunk, targets[block],
                    vocab_start + chunk.start, logit, select_rows(rows, block), target_values,
                    d_logits, config,
                )  # fmt: skip
                _accumulate(d_logits, block_hidden, weight, block, chunk, grads, grad_hidden)
        return grads._replace(hidden=_result(grad_hidden))

    def _grads_from_kept(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        rows: BackwardRows,
        wanted: Wanted,
        grad_hidden_dtype: torch.dtype | None,
        kept: torch.Tensor,
        kept_writable: bool,
        blocks: list[slice],
    ) -> Grads:
        """`backward_grads` from ``kept`` logits: per token block, `row_dlogits` writes the whole
        shard's d_logits over the block's kept logits (``kept_writable``) or into a buffer of the
        block's size (the same numbers either way), then grad_hidden's rows are one GEMM over the
        shard, rounded once to ``grad_hidden_dtype`` (no fp32 sums across vocab chunks), and
        grad_weight and grad_bias take the block as `_accumulate` does."""
        (num_tokens, hidden_size), vocab = hidden.shape, slice(0, weight.shape[0])
        _, grads = self._grad_buffers(hidden, weight, wanted._replace(hidden=False), None, blocks)
        if wanted.hidden:
            dtype = grad_hidden_dtype or torch.float32
            grads = grads._replace(
                hidden=torch.empty(num_tokens, hidden_size, dtype=dtype, device=hidden.device)
            )
        rows = _scaled(rows, logit.dlogit_scale)
        targets, bias = targets.contiguous(), _contiguous(bias)
        buffer = None if kept_writable else torch.empty_like(kept[blocks[0]])
        for block in blocks:
            block_d_logits = kept[block] if buffer is None else buffer[: block.stop - block.start]
            row_dlogits(
                kept[block], block_d_logits, bias, targets[block], vocab_start, logit,
                select_rows(rows, block), entropy=True,
            )  # fmt: skip
            if grads.hidden is not None:
                mm_into(block_d_logits, weight, out=grads.hidden[block])
            _accumulate(block_d_logits, hidden[block], weight, block, vocab, grads, None)
        return grads

    def _grad_buffers(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        wanted: Wanted,
        grad_hidden_dtype: torch.dtype | None,
        blocks: list[slice],
    ) -> tuple[RowSum | None, Grads]:
        """The backward's gradient sums: grad_hidden's fp32 `RowSum`, grad_weight (in weight's
        dtype, written chunk by chunk, unless several token blocks add up in fp32: a low-precision
        sum would round once per block) and grad_bias (fp32)."""
        (num_tokens, hidden_size), vocab_local = hidden.shape, weight.shape[0]
        device = hidden.device
        grad_hidden = None
        if wanted.hidden:
            dtype = grad_hidden_dtype or torch.float32
            grad_hidden = RowSum(num_tokens, hidden_size, dtype, device)
        grad_weight = grad_bias = None
        if wanted.weight:  # every chunk writes its rows, so only T = 0 needs the zeros
            alloc = torch.empty if num_tokens else torch.zeros
            fp32 = self._config().grad_weight_fp32 or len(blocks) > 1
            dtype = torch.float32 if fp32 else weight.dtype
            grad_weight = alloc(vocab_local, hidden_size, dtype=dtype, device=device)
        if wanted.bias:
            grad_bias = torch.zeros(vocab_local, dtype=torch.float32, device=device)
        return grad_hidden, Grads(None, grad_weight, grad_bias)

    def loss_grads_in_forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        vocab_start: int,
        logit: LogitOptions,
        merge: GlobalMerge,
        wanted: Wanted,
        grad_weight_out: torch.Tensor | None = None,
        chunk_rows: int | None = None,
    ) -> tuple[ShardStats, Grads]:
        """See `lce.backends.torch_chunked.TorchChunkedStages.loss_grads_in_forward`.

        Per token chunk: logits by cuBLAS in weight's dtype (GEMM 1; rounded like the stock path's
        and the torch backend's logits), `row_stats_into`, ``merge``, `row_dlogits` in place, then
        grad_hidden rows (GEMM 2), the fp32 grad_weight accumulation (GEMM 3, into
        ``grad_weight_out`` when given) and grad_bias's column sums.
        """
        _check_operands(hidden, weight, targets)
        num_tokens, vocab_local = hidden.shape[0], weight.shape[0]
        device = hidden.device
        # Each chunk's `row_stats_into` writes its rows; an empty shard's stay empty (no launch
        # before the first GEMM where they are written: after a host sync the GPU waits for it).
        stats = torch.empty(len(fields(ShardStats)), num_tokens, dtype=torch.float32, device=device)
        if vocab_local == 0:
            stats.zero_()[0] = float("-inf")
        grads = _loss_grad_buffers(hidden, weight, wanted, grad_weight_out)
        own_buffer = wanted.weight and grad_weight_out is None
        shard_stats = ShardStats(*stats.unbind(0))
        step = chunk_rows or self.loss_chunk_rows(
            num_tokens, vocab_local, hidden.shape[1], weight.element_size()
        )
        buffer = torch.empty(min(step, num_tokens), vocab_local, dtype=weight.dtype, device=device)
        targets, bias = targets.contiguous(), _contiguous(bias)
        for start in range(0, num_tokens, step):
            rows = slice(start, min(start + step, num_tokens))
            if vocab_local == 0:  # an empty shard still takes part in each chunk's merge
                merge(shard_stats, rows)
                continue
            logits = buffer[: rows.stop - start]
            mm_into(hidden[rows], weight.T, out=logits)  # then d_logits, in place
            row_stats_into(logits, bias, targets[rows], vocab_start, logit, stats[:, rows])
            merged = _scaled(merge(shard_stats, rows), logit.dlogit_scale)
            row_dlogits(logits, logits, bias, targets[rows], vocab_start, logit, merged)
            if grads.hidden is not None:
                mm_into(logits, weight, out=grads.hidden[rows])
            if own_buffer and start == 0:
                mm_into(logits.T, hidden[rows], out=grads.weight)
            elif grads.weight is not None:
                addmm_(grads.weight, logits.T, hidden[rows])
            if grads.bias is not None:
                grads.bias.add_(logits.sum(dim=0, dtype=torch.float32))
        return shard_stats, grads

    def loss_chunk_rows(
        self, num_tokens: int, vocab_local: int, hidden_size: int, itemsize: int
    ) -> int:
        """Token rows per logits chunk: at most `loss_chunk_budget` bytes, the chunks of one
        call equal and a multiple of `LOSS_ROW_ALIGN` where that fits (GEMM tiles)."""
        budget = loss_chunk_budget(self._config(), num_tokens, vocab_local, hidden_size, itemsize)
        num_tokens = max(num_tokens, 1)
        most = max(1, budget // (itemsize * max(vocab_local, 1)))
        rows = -(-num_tokens // -(-num_tokens // most))  # ceil(T / number of chunks)
        aligned = -(-rows // LOSS_ROW_ALIGN) * LOSS_ROW_ALIGN
        return min(num_tokens, aligned if aligned <= most else rows)


def loss_chunk_budget(
    config: TritonConfig, num_tokens: int, vocab_local: int, hidden_size: int, itemsize: int
) -> int:
    """Most bytes of one logits chunk of the 3-GEMM loss: ``loss_chunk_bytes``, or where more,
    what ``loss_peak_grads`` times the gradients' bytes leaves beside the pass's fp32
    grad_hidden (see `TritonConfig`)."""
    grads = (num_tokens + vocab_local) * hidden_size * itemsize
    beside = 4 * num_tokens * hidden_size
    return max(config.loss_chunk_bytes, int(config.loss_peak_grads * grads) - beside)


def _result(grad_hidden: RowSum | None) -> torch.Tensor | None:
    return None if grad_hidden is None else grad_hidden.result()


def _contiguous(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.contiguous()


def _accumulate(
    d_logits: torch.Tensor,
    block_hidden: torch.Tensor,
    weight: torch.Tensor,
    block: slice,
    chunk: slice,
    grads: Grads,
    grad_hidden: RowSum | None,
) -> None:
    """One d_logits chunk's share of every gradient: grad_weight's chunk rows (written by the
    first token block, added to by the others), grad_hidden's block rows, grad_bias's chunk."""
    if grads.weight is not None and block.start == 0:
        mm_into(d_logits.T, block_hidden, out=grads.weight[chunk])
    elif grads.weight is not None:
        addmm_(grads.weight[chunk], d_logits.T, block_hidden)
    if grad_hidden is not None:
        grad_hidden.add(block, d_logits, weight[chunk])
    if grads.bias is not None:  # the same rounded d_logits the GEMMs take
        grads.bias[chunk] += d_logits.sum(dim=0, dtype=torch.float32)


def _loss_grad_buffers(
    hidden: torch.Tensor, weight: torch.Tensor, wanted: Wanted, grad_weight_out: torch.Tensor | None
) -> Grads:
    """The 3-GEMM loss's fp32 gradients: grad_hidden (each chunk writes its rows; an empty shard
    writes none), grad_weight (``grad_weight_out``, or a buffer the first chunk writes; T = 0
    needs zeros) and grad_bias."""
    (num_tokens, hidden_size), vocab_local = hidden.shape, weight.shape[0]
    fp32 = dict(dtype=torch.float32, device=hidden.device)
    grad_hidden = grad_weight = grad_bias = None
    if wanted.hidden:
        alloc = torch.empty if vocab_local else torch.zeros
        grad_hidden = alloc(num_tokens, hidden_size, **fp32)
    if wanted.weight:
        alloc = torch.empty if num_tokens else torch.zeros
        own = grad_weight_out is None
        grad_weight = alloc(vocab_local, hidden_size, **fp32) if own else grad_weight_out
    if wanted.bias:
        grad_bias = torch.zeros(vocab_local, **fp32)
    return Grads(grad_hidden, grad_weight, grad_bias)


def _scaled(rows: BackwardRows, scale: float) -> BackwardRows:
    """``rows`` for the d_logits kernels: contiguous fp32, the ``d_z`` coefficients times
    ``scale`` (``logit.dlogit_scale``: each lane's ``d_a`` is then ``d_z`` times the softcap's
    slope alone)."""
    return BackwardRows(
        *(s.float().contiguous() for s in (rows.max, rows.log_sumexp, rows.centred_mean)),
        *((s.float() * scale).contiguous() for s in (rows.softmax_coef, rows.grad_entropy)),
        *((s.float() * scale).contiguous() for s in (rows.target_grad, rows.uniform)),
    )


def chunk_width(num_tokens: int, vocab_local: int, itemsize: int, budget: int, block_v: int) -> int:
    """Vocab rows per d_logits chunk: ``budget`` bytes worth, whole tiles, at most V_local."""
    width = budget // (num_tokens * itemsize) // block_v * block_v
    return min(vocab_local, max(block_v, width))


def _padded(width: int) -> int:
    """d_logits rows padded to 16 elements: the kernel's stores stay aligned (vectorized), and its
    row stride is one compiled specialization whatever V is."""
    return -(-width // 16) * 16


def _dlogits_chunks(
    num_tokens: int,
    weight: torch.Tensor,
    grad_weight: torch.Tensor | None,
    config: TritonConfig,
) -> list[tuple[slice, torch.Tensor]]:
    """The backward's vocab chunks in order, each with its ``[num_tokens, width]`` d_logits buffer.

    Chunks are ``chunk_bytes`` wide. With ``grad_weight`` (written chunk by chunk, in order) in
    weight's dtype, a chunk's buffer lies in grad_weight's rows past the chunk, not written yet:
    no buffer of its own, so chunks there are up to ``aliased_chunk_bytes`` wide. The chunks
    narrow as those rows run out; once a ``tail_chunk_bytes`` chunk no longer fits there, a
    buffer of that size takes the rest.
    """
    vocab_local, block_v = weight.shape[0], config.backward.block_v

    def width(budget: int) -> int:
        return chunk_width(num_tokens, vocab_local, weight.element_size(), budget, block_v)

    widest = width(config.chunk_bytes)
    tail = width(config.tail_chunk_bytes)
    inside = grad_weight is not None and grad_weight.dtype == weight.dtype and tail < widest
    if inside:
        widest = width(max(config.chunk_bytes, config.aliased_chunk_bytes))
    else:
        tail = widest  # every chunk in one buffer of its own
    chunks: list[tuple[slice, torch.Tensor]] = []
    tail_buffer = None
    start = 0
    while start < vocab_local:
        rest = vocab_local - start
        d_logits = None
        if inside:
            d_logits = _inside(
                grad_weight, start, min(widest, rest), min(tail, rest), num_tokens, block_v
            )
        if d_logits is None:
            if tail_buffer is None:
                tail_buffer = torch.empty(
                    num_tokens, _padded(min(tail, rest)), dtype=weight.dtype, device=weight.device
                )
            d_logits = tail_buffer[:, : min(tail, rest)]
        chunks.append((slice(start, start + d_logits.shape[1]), d_logits))
        start += d_logits.shape[1]
    return chunks


def _inside(
    grad_weight: torch.Tensor,
    start: int,
    widest: int,
    narrowest: int,
    num_tokens: int,
    block_v: int,
) -> torch.Tensor | None:
    """d_logits of the widest chunk at ``start`` (``widest`` down to ``narrowest`` columns, whole
    tiles) whose ``[num_tokens, width]`` buffer fits in grad_weight's rows past the chunk's own;
    None where none does."""
    flat, hidden_size = grad_weight.view(-1), grad_weight.shape[1]
    width = widest
    while width >= narrowest and width > 0:
        first = -(-(start + width) * hidden_size // ALIAS_ALIGN) * ALIAS_ALIGN
        padded = _padded(width)
        if first + num_tokens * padded <= flat.numel():
            return flat[first : first + num_tokens * padded].view(num_tokens, padded)[:, :width]
        width = (width - 1) // block_v * block_v
    return None
