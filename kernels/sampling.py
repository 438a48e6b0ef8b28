"""Grammar token bitmask applied to a batch of logits in one launch.

Reference: ``worker.vocab_mask.unpack_vocab_mask`` then ``masked_fill_(~allowed, -inf)``, which
materialises a [B, V] bool tensor (V = 128k for Llama 3). The kernel reads the packed int32
words directly (xgrammar layout: bit j of word w allows token 32 * w + j).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_bitmask_kernel(Logits, Mask, vocab_size, stride_lb, stride_mb,
                          BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    words = tl.load(Mask + b * stride_mb + offs // 32, mask=in_vocab, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(Logits + b * stride_lb + offs, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[b, t] = -inf`` where bit t of row b of ``bitmask`` is 0. Mutates ``logits``.

    logits: [B, V] float (contiguous rows); bitmask: [B, >= ceil(V / 32)] int32.
    """
    batch, vocab = logits.shape
    words = triton.cdiv(vocab, 32)
    if bitmask.dim() != 2 or bitmask.shape[0] != batch or bitmask.shape[1] < words:
        raise ValueError(f"vocab_mask: expected shape [{batch}, >= {words}], "
                         f"got {list(bitmask.shape)}")
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("apply_token_bitmask_: logits and bitmask rows must be contiguous")
    block = 1024
    _apply_bitmask_kernel[(batch, triton.cdiv(vocab, block))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block)
