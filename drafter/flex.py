"""Block-sparse attention for training on CUDA (FlexAttention).

With ~512 blocks per sequence the dense mask of `model.block_mask` is mostly False: a block sees the
context before its anchor and its own block_size tokens, nothing of the other blocks. FlexAttention
skips the masked tiles instead of computing and discarding them. Same visibility rules as
`drafter.model.block_mask` (the GPU check compares the two).
"""

from __future__ import annotations

import functools

import torch

# The tiles: the BlockMask's block size (query, key) and the kernels' options (torch's FlexKernelOptions). torch's
# defaults (128 x 128, autotuned kernels) are sized for long causal masks; a draft block is 16 queries that see a
# context prefix and their own block. bench/flex_tune.py measures alternatives on the GPU (bench/RESULTS.md).
MASK_BLOCK: tuple[int, int] = (128, 128)
KERNEL_OPTIONS: dict = {}


def available() -> bool:
    try:
        from torch.nn.attention import flex_attention as _  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention as fa

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fa, dynamic=True)


def flex_attention(q, k, v, block_mask, enable_gqa: bool = False):
    return _compiled()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=KERNEL_OPTIONS or None)


def block_sparse_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor | None,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
    first: torch.Tensor | None = None,
):
    from torch.nn.attention.flex_attention import create_block_mask

    b, q_len = anchors.shape[0], anchors.shape[1] * block_size
    mask_mod = visibility(anchors, keep, ctx_len, block_size, window, first)
    return create_block_mask(mask_mod, b, None, q_len, ctx_len + q_len, device=anchors.device, BLOCK_SIZE=MASK_BLOCK)


def visibility(
    anchors: torch.Tensor,
    keep: torch.Tensor | None,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
    first: torch.Tensor | None = None,
):
    """The mask_mod (batch, head, query, key) -> visible of `drafter.model.block_mask`'s rules."""
    keep_t = keep if keep is not None else torch.ones_like(anchors, dtype=torch.bool)

    def mask_mod(bi, _h, q_idx, kv_idx):
        blk, off = q_idx // block_size, q_idx % block_size
        a = anchors[bi, blk]
        is_ctx = kv_idx < ctx_len
        ctx_ok = is_ctx & (kv_idx < a) & keep_t[bi, blk]
        if first is not None:  # a packed row: from the anchor's sample's start
            ctx_ok = ctx_ok & (kv_idx >= first[bi, blk])
        k_rel = kv_idx - ctx_len
        k_blk, k_off = k_rel // block_size, k_rel % block_size
        blk_ok = (~is_ctx) & (k_blk == blk)
        if window is not None:
            ctx_ok = ctx_ok & (a + off - kv_idx < window)
            blk_ok = blk_ok & (k_off <= off) & (off - k_off < window)
        return ctx_ok | blk_ok

    return mask_mod
