"""train.attention_groups: a row's draft blocks in query groups along the batch axis (drafter/flex.py QueryGroups)
compute the ungrouped attention: the same outputs and the same gradients for queries, context keys and block keys,
with padded rows, packed rows, a sliding window and block counts that do not divide into the groups.

FlexAttention has no backward on the CPU, so the gradients are checked with a dense attention that reads the grouped
BlockMask's own mask_mod (the layout, padding and gradient sums are what grouping adds); the flex kernel's forward
runs on the grouped mask too, eagerly, and in the drafter's forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torch.nn.attention.flex_attention import flex_attention as eager_flex

from dflash_pipeline.drafter import flex
from dflash_pipeline.drafter.batching import collate, sample_anchors
from dflash_pipeline.drafter.model import FULL, SLIDING, DFlashDrafter, block_mask

from .test_packing import BS, SPEC, _packed_anchors, _samples

torch.set_num_threads(1)
HEADS, KV_HEADS, D = 4, 2, 8


def _dense(q, k, v, mask, enable_gqa):
    """sdpa under `mask` as elements: a BlockMask's mask_mod, or a bool [B, 1, Q, KV] tensor."""
    if not isinstance(mask, torch.Tensor):
        mask = create_mask(mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device="cpu")
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)


def _case(packed: bool):
    if packed:
        return _packed_anchors()
    batch = collate(_samples())
    a, keep = sample_anchors(batch["loss_mask"], 6, torch.Generator().manual_seed(5))
    return a, keep, batch["input_ids"].shape[1], None


def _qkv(rows: int, q_len: int, kv_len: int):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(rows, HEADS, q_len, D, generator=g)
    k, v = (torch.randn(rows, KV_HEADS, kv_len, D, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("groups", [2, 3, 4, 64])  # 64: more groups than blocks (one block each)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_grouped_attention_computes_the_ungrouped_outputs_and_gradients(packed, window, groups):
    a, keep, t, first = _case(packed)
    q_len = a.shape[1] * BS
    grouped = flex.block_sparse_mask(a, keep, t, BS, window, first, groups=groups)
    n = min(groups, a.shape[1])
    assert isinstance(grouped, flex.QueryGroups) and grouped.groups == n and grouped.pad == (-a.shape[1] % n) * BS
    ref_in, got_in = _qkv(a.shape[0], q_len, t + q_len), _qkv(a.shape[0], q_len, t + q_len)
    ref = _dense(*ref_in, block_mask(a, keep, t, BS, window, first), True)
    got = flex.grouped_attention(*got_in, grouped, enable_gqa=True, attend=_dense)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    ref.backward(do)
    got.backward(do)
    for name, x, y in zip("qkv", got_in, ref_in):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6, msg=f"grad of {name}")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_flex_kernel_on_the_grouped_mask_gives_the_ungrouped_output(packed):
    a, keep, t, first = _case(packed)
    q_len = a.shape[1] * BS
    q, k, v = (x.detach() for x in _qkv(a.shape[0], q_len, t + q_len))
    ref = eager_flex(q, k, v, block_mask=flex.block_sparse_mask(a, keep, t, BS, 5, first), enable_gqa=True)
    grouped = flex.block_sparse_mask(a, keep, t, BS, 5, first, groups=4)
    got = flex.grouped_attention(q, k, v, grouped, True, attend=lambda *x: eager_flex(*x[:3], block_mask=x[3],
                                                                                       enable_gqa=x[4]))  # fmt: skip
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_the_drafter_forward_with_query_groups_is_the_ungrouped_one(monkeypatch):
    """The wiring: DFlashDrafter.block_masks(..., groups) and its attention layers (a full and a sliding one)."""
    monkeypatch.setattr(flex, "_compiled", lambda: eager_flex)  # (inductor's CPU flex kernel needs a C++ toolchain)
    assert SPEC.layer_types == [FULL, SLIDING]
    torch.manual_seed(0)
    model = DFlashDrafter(SPEC).eval()
    a, keep, t, first = _case(packed=False)
    rows, q_len = a.shape[0], a.shape[1] * BS
    g = torch.Generator().manual_seed(3)
    args = (
        torch.randn(rows, t, len(SPEC.target_layer_ids) * SPEC.hidden_size, generator=g),
        torch.randn(rows, q_len, SPEC.hidden_size, generator=g),
        torch.arange(t).expand(rows, t),
        (a[:, :, None] + torch.arange(BS)).reshape(rows, q_len),
    )
    with torch.no_grad():
        ref = model(*args, model.block_masks(a, keep, t, flex=True))
        got = model(*args, model.block_masks(a, keep, t, flex=True, groups=3))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
