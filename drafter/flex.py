"""Block-sparse attention for training on CUDA (FlexAttention).

With ~512 blocks per sequence the dense mask of `model.block_mask` is mostly False: a block sees the
context before its anchor and its own block_size tokens, nothing of the other blocks. FlexAttention
skips the masked tiles instead of computing and discarding them. Same visibility rules as
`drafter.model.block_mask` (the GPU check compares the two).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    groups: int = 1,
):
    """The BlockMask of `drafter.model.block_mask`'s rules; with groups > 1 a `QueryGroups` (see there)."""
    pad = 0
    groups = min(groups, anchors.shape[1])  # (a group per block at most: more would only add padding)
    if groups > 1:
        b, n = anchors.shape
        pad = -n % groups  # dropped blocks (keep False: they see only themselves) up to a multiple of groups
        keep = keep if keep is not None else torch.ones_like(anchors, dtype=torch.bool)
        anchors, keep = F.pad(anchors, (0, pad)), F.pad(keep, (0, pad), value=False)
        first = F.pad(first, (0, pad)) if first is not None else None
        anchors, keep = anchors.reshape(b * groups, -1), keep.reshape(b * groups, -1)
        first = first.reshape(b * groups, -1) if first is not None else None
    mask = tile_mask(anchors, keep, ctx_len, block_size, window, first)
    return QueryGroups(mask, groups, pad * block_size, ctx_len) if groups > 1 else mask


def tile_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor | None,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
    first: torch.Tensor | None = None,
):
    """The BlockMask that torch's `create_block_mask(visibility(...))` builds, equal tensor for tensor, without
    the dense [B, Q, ctx_len + Q] mask that it evaluates first.

    Why: that dense mask grows with the square of a row's length. For four samples packed in a row (32,768 queries,
    ~36,000 keys) it is 1.2 billion elements and a dozen elementwise passes over them every step (on an H100 its
    named ops alone took 3.8% of the step's GPU time, more went to unnamed ones: RESULTS.md, Training, 2026-12-06).
    Here each query's visible keys are two intervals (its context range and its own block's keys), so a tile's count
    of visible pairs is a sum of interval overlaps: [B, Q, key tiles]."""
    from torch.nn.attention.flex_attention import BlockMask

    qb, kb = MASK_BLOCK
    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    dev = anchors.device
    i32 = torch.int32  # (positions fit; half the memory of int64 in the [B, Q, key tiles] counts)
    off = torch.arange(block_size, device=dev, dtype=i32)
    a = anchors.to(i32)[:, :, None].expand(b, n, block_size)  # [B, N, bs]: per query
    lo_c = first.to(i32)[:, :, None].expand(b, n, block_size) if first is not None else torch.zeros_like(a)
    hi_c = a.clamp(max=ctx_len)
    if keep is not None:  # a dropped block sees no context
        hi_c = torch.where(keep[:, :, None], hi_c, 0)
    base = ctx_len + torch.arange(n, device=dev, dtype=i32)[None, :, None] * block_size  # where each block's keys begin
    lo_b, hi_b = base, base + block_size
    if window is not None:  # query pos - key pos < window; causal inside the block
        lo_c = lo_c.maximum(a + off - window + 1)
        lo_b, hi_b = base + (off - window + 1).clamp(min=0), base + off + 1
    starts = torch.arange(0, kv_len, kb, device=dev, dtype=i32)
    ends = (starts + kb).clamp(max=kv_len)

    def overlap(lo, hi):  # [B, Q, key tiles]: how many of a tile's keys lie in [lo, hi) of each query
        lo, hi = (t.expand(b, n, block_size).reshape(b, q_len, 1) for t in (lo, hi))
        return (torch.minimum(hi, ends) - torch.maximum(lo, starts)).clamp(min=0)

    seen = overlap(lo_c, hi_c) + overlap(lo_b, hi_b)
    q_tiles = -(-q_len // qb)
    seen = F.pad(seen, (0, 0, 0, q_tiles * qb - q_len)).view(b, q_tiles, qb, -1).sum(2)  # [B, query tiles, key tiles]
    full = seen == qb * kb
    return BlockMask.from_kv_blocks(
        *_ordered((seen > 0) & ~full),
        *_ordered(full),
        BLOCK_SIZE=(qb, kb),
        mask_mod=visibility(anchors, keep, ctx_len, block_size, window, first),
        seq_lengths=(q_len, kv_len),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, QT, KT] bool -> a BlockMask's (count, indices) [B, 1, QT] and [B, 1, QT, KT] int32: each row's tiles
    first, in order (as torch orders them: a stable descending sort)."""
    d = tiles[:, None].to(torch.int32)
    return d.sum(-1, dtype=torch.int32), torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32)


@dataclass(frozen=True)
class QueryGroups:
    """A row's draft blocks split into `groups` consecutive groups laid along the batch axis, each group's queries
    with the context keys and their own blocks' keys (`mask`: the BlockMask of that layout).

    Why: flex attention's backward computes a key tile's gradient in one program per (key tile, KV head), looping
    over every query tile that sees it (torch's `flex_attention_backward_grid`). A context tile near the start of a
    row is seen by all 512 blocks' queries: 64 query tiles x 4 query heads per KV head = 256 iterations in one
    program, while the other programs finish in a few. That serial loop, not the work, sets the time (bench/RESULTS.md,
    Training, 2026-12-03: 4.5 ms at 900 context keys and 4.6 ms at 2048). With G groups each context tile has G
    programs of 1/G of the loop, and autograd sums their gradients: the same result up to the order of that sum."""

    mask: object  # torch.nn.attention.flex_attention.BlockMask
    groups: int
    pad: int  # query rows added at the end of a row (blocks up to a multiple of groups)
    ctx_len: int


def grouped_attention(q, k, v, g: QueryGroups, enable_gqa: bool = False, attend=None):
    """`attend(q, k, v, block_mask, enable_gqa)` (default: flex_attention) over the layout of `g`; q [B, H, Q, D]
    (a row's blocks' queries), k / v [B, Hkv, ctx_len + Q, D] (context keys, then the blocks'): out [B, H, Q, D]."""
    attend = attend or flex_attention
    b, _, q_len, _ = q.shape
    n, c = g.groups, g.ctx_len

    def split(t):  # [B, h, n * m, D] -> [B * n, h, m, D]
        t = F.pad(t, (0, 0, 0, g.pad)) if g.pad else t
        return t.unflatten(2, (n, -1)).transpose(1, 2).flatten(0, 1)

    def context(t):  # [B, h, c, D] -> the same keys for each group, [B * n, h, c, D]
        return t[:, None].expand(b, n, *t.shape[1:]).flatten(0, 1)

    kg = torch.cat([context(k[:, :, :c]), split(k[:, :, c:])], dim=2)
    vg = torch.cat([context(v[:, :, :c]), split(v[:, :, c:])], dim=2)
    out = attend(split(q), kg, vg, g.mask, enable_gqa)
    return out.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)[:, :, :q_len]


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
