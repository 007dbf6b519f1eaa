"""drafter/flex.py tile_mask: the flex BlockMask computed per tile from each query's visible key intervals is torch's
`create_block_mask` over the dense mask, tensor for tensor (partial and full tiles, their order, the transposed
query-side indices), for padded and packed rows, dropped blocks, sliding windows, query groups, tiles that do not
divide the lengths, and tile shapes other than the default. (Its speed is bench/RESULTS.md's: the dense mask grows
with the square of a packed row's length.)"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflash_pipeline.drafter import flex

from .test_packing import BS, _packed_anchors

torch.set_num_threads(1)
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
FIELDS += tuple(f.replace("kv", "q") for f in FIELDS)  # (the query side that from_kv_blocks derives)


def _reference(a, keep, ctx, bs, window, first):
    mod = flex.visibility(a, keep, ctx, bs, window, first)
    n = a.shape[1] * bs
    return create_block_mask(mod, a.shape[0], None, n, ctx + n, device="cpu", BLOCK_SIZE=flex.MASK_BLOCK)


def _assert_same(got, ref):
    assert got.seq_lengths == ref.seq_lengths and got.BLOCK_SIZE == ref.BLOCK_SIZE
    for name in FIELDS:
        x, y = getattr(got, name), getattr(ref, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    bs = (4, 8, 16)[seed % 3]
    rows, blocks = int(torch.randint(1, 3, (), generator=g)), int(torch.randint(1, 40, (), generator=g))
    ctx = int(torch.randint(bs + 1, 700, (), generator=g))
    a = torch.randint(1, ctx, (rows, blocks), generator=g).sort(-1).values
    keep = torch.rand(rows, blocks, generator=g) > 0.2 if seed % 2 else None
    first = (a * torch.rand(rows, blocks, generator=g)).long() if seed % 4 >= 2 else None
    return a, keep, ctx, bs, first


@pytest.mark.parametrize("tiles", [(128, 128), (64, 128), (128, 64)])
@pytest.mark.parametrize("window", [None, 5, 40, 200])
@pytest.mark.parametrize("seed", range(6))
def test_the_tile_mask_is_create_block_mask(monkeypatch, seed, window, tiles):
    monkeypatch.setattr(flex, "MASK_BLOCK", tiles)
    a, keep, ctx, bs, first = _random_case(seed)
    _assert_same(flex.tile_mask(a, keep, ctx, bs, window, first), _reference(a, keep, ctx, bs, window, first))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_the_mask_of_a_packed_row_and_of_query_groups_is_create_block_mask(window, groups):
    """The masks training builds: block_sparse_mask of a packed row (the anchors' samples' starts), and its layout in
    query groups (each group with the context and its own blocks)."""
    a, keep, t, first = _packed_anchors()
    got = flex.block_sparse_mask(a, keep, t, BS, window, first, groups=groups)
    if groups > 1:  # the reference over the grouped layout: the same rows as block_sparse_mask lays them out
        n = a.shape[1]
        pad = -n % groups
        a = torch.nn.functional.pad(a, (0, pad)).reshape(a.shape[0] * groups, -1)
        keep = torch.nn.functional.pad(keep, (0, pad), value=False).reshape(a.shape[0], -1)
        first = torch.nn.functional.pad(first, (0, pad)).reshape(a.shape[0], -1)
        got = got.mask
    _assert_same(got, _reference(a, keep, t, BS, window, first))


def test_a_long_packed_row_builds_without_the_dense_mask():
    """Four 8B-shape samples packed in a row: 32,768 queries over ~36,000 keys. The dense mask would be 1.2 billion
    elements (too much for this test's memory); the tile mask counts [queries, key tiles], ~9 million."""
    g = torch.Generator().manual_seed(0)
    ctx = 3600
    a = torch.randint(1, ctx, (1, 2048), generator=g).sort(-1).values
    first = (a // 900) * 900
    mask = flex.tile_mask(a, None, ctx, 16, None, first)
    assert mask.seq_lengths == (2048 * 16, ctx + 2048 * 16)
    assert mask.kv_num_blocks.shape == (1, 1, 256)
