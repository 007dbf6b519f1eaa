"""train.pack: a micro-batch's samples in one row instead of padded rows computes the padded step.

The real training step (drafter/train.py's _micro_step) runs on both forms of the same three samples, with a
sliding-window layer and the distillation loss too: the same anchors, the same supervised tokens, the same loss and
gradients within float32 rounding, and less attention work (no padding, no dropped blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dflash_pipeline.drafter.batching import collate, pack, sample_anchors, segment_bounds
from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.model import FULL, SLIDING, DFlashDrafter, DraftSpec, RMSNorm
from dflash_pipeline.drafter.precision import ComputeCopy
from dflash_pipeline.drafter.target_head import TargetHead
from dflash_pipeline.drafter.train import _Job, _micro_step

torch.set_num_threads(1)
H, K, V, BS = 32, 3, 97, 4
SPEC = DraftSpec(
    hidden_size=H,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    vocab_size=V,
    target_layer_ids=[1, 2, 3],
    num_target_layers=4,
    block_size=BS,
    mask_token_id=V - 1,
    sliding_window=5,
    layer_types=[FULL, SLIDING],
)


def _samples() -> list[dict]:
    """Three samples of different lengths: a prompt (unsupervised) then a response; the middle one supervises only
    its last two tokens, so its row of the padded batch holds dropped blocks."""
    g = torch.Generator().manual_seed(0)
    out = []
    for n, prompt in ((23, 6), (9, 7), (31, 4)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[prompt:] = True
        out.append(
            {
                "input_ids": torch.randint(0, V - 1, (n,), generator=g),
                "loss_mask": mask,
                "hidden": torch.randn(n, K, H, generator=g) * 3,
                "last_hidden": torch.randn(n, H, generator=g) * 3,
            }
        )
    return out


def _job(distill: bool) -> _Job:
    torch.manual_seed(0)
    model = DFlashDrafter(SPEC)
    work = ComputeCopy(model, "fp32")
    g = torch.Generator().manual_seed(1)
    embed, lm_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    embed.weight.data = torch.randn(V, H, generator=g)
    lm_head.weight.data = torch.randn(V, H, generator=g) * 0.3
    head = TargetHead(embed, RMSNorm(H, 1e-6), lm_head)
    cfg = TrainConfig(block_size=BS, anchors_per_sample=6, distill=distill, device="cpu")
    ds = SimpleNamespace(precision="full", logical_torch=torch.float32)
    cpu = torch.device("cpu")
    return _Job(cfg, ds, SPEC, head, model, work, work.module, cpu, "fp32", False)


def _step(batch: dict, distill: bool):
    job = _job(distill)
    loss, stats = _micro_step(job, batch, seed=1234, sync=True, scale=1.0)
    return loss, stats, {n: p.grad.clone() for n, p in job.work.module.named_parameters()}


def test_packed_anchors_are_the_padded_batchs_per_sample():
    items = _samples()
    padded, packed = collate(items), pack(items)
    a, keep = sample_anchors(padded["loss_mask"], 6, torch.Generator().manual_seed(5))
    pa, pkeep = sample_anchors(packed["loss_mask"], 6, torch.Generator().manual_seed(5), packed["starts"])
    first, end = segment_bounds(pa, packed["starts"], packed["input_ids"].shape[1])
    assert pkeep.all() and pa.shape[1] == int(keep.sum())
    assert torch.equal(pa[0] - first[0], a[keep])  # the same anchors, each in its own sample
    assert torch.equal(end[0] - first[0], padded["lengths"].repeat_interleave(keep.sum(1)))
    assert torch.equal(packed["positions"][0], torch.cat([torch.arange(n) for n in padded["lengths"]]))
    for row, it in enumerate(items):  # the row's tokens and states are the sample's, unpadded
        s, n = int(packed["starts"][row]), len(it["input_ids"])
        assert torch.equal(packed["hidden"][0, s : s + n], it["hidden"].reshape(n, -1))
        assert torch.equal(packed["input_ids"][0, s : s + n], it["input_ids"])
    # no anchor at a sample's last token: its "next token" would be the next sample's first
    assert not set((packed["starts"][1:] - 1).tolist()) & set(pa[0].tolist())


@pytest.mark.parametrize("distill", [False, True], ids=["ce", "distill"])
def test_a_packed_step_computes_the_padded_step(distill):
    items = _samples()
    loss, stats, grads = _step(collate(items), distill)
    ploss, pstats, pgrads = _step(pack(items), distill)
    assert int(pstats["tokens"]) == int(stats["tokens"]) > 0
    assert int(pstats["correct"]) == int(stats["correct"])
    torch.testing.assert_close(ploss, loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(pgrads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # the work: the padded batch pads every row to 6 blocks and to the longest context; packed, neither
    assert pstats["queries"] < stats["queries"] and pstats["attn_pairs"] < stats["attn_pairs"]


def _packed_anchors():
    packed = pack(_samples())
    a, keep = sample_anchors(packed["loss_mask"], 6, torch.Generator().manual_seed(5), packed["starts"])
    t = packed["input_ids"].shape[1]
    return a, keep, t, segment_bounds(a, packed["starts"], t)[0]


def test_a_block_never_sees_another_samples_context():
    """The packed masks: every query of a block sees context from its sample's start to its anchor only (the
    sliding layer: the last `window` positions of that), and of the blocks only its own."""
    a, keep, t, first = _packed_anchors()
    masks = DFlashDrafter(SPEC).block_masks(a, keep, t, first=first)
    for kind, mask in masks.items():
        for q in range(a.shape[1] * BS):
            n, off = divmod(q, BS)
            lo = (
                int(first[0, n])
                if kind == FULL
                else max(int(first[0, n]), int(a[0, n]) + off - SPEC.sliding_window + 1)
            )
            ctx = mask[0, 0, q, :t].nonzero().flatten().tolist()
            assert ctx == list(range(lo, int(a[0, n]))), (kind, q)
            own = mask[0, 0, q, t:].nonzero().flatten().tolist()
            assert own and all(k // BS == n for k in own), (kind, q)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_flex_mask_is_the_dense_mask(packed, window):
    """FlexAttention's mask_mod (the CUDA path) against the dense mask of sdpa, evaluated on CPU by torch's
    create_mask: the same visibility for padded rows and packed ones."""
    from torch.nn.attention.flex_attention import create_mask

    from dflash_pipeline.drafter import flex
    from dflash_pipeline.drafter.model import block_mask

    if packed:
        a, keep, t, first = _packed_anchors()
    else:
        batch = collate(_samples())
        t, first = batch["input_ids"].shape[1], None
        a, keep = sample_anchors(batch["loss_mask"], 6, torch.Generator().manual_seed(5))
    q = a.shape[1] * BS
    got = create_mask(flex.visibility(a, keep, t, BS, window, first), a.shape[0], 1, q, t + q, device="cpu")
    assert torch.equal(got, block_mask(a, keep, t, BS, window, first))


def test_a_micro_batch_with_nothing_supervised_is_a_zero_step():
    """No sample supervises a token: one dropped block, a zero loss with a graph (DDP ranks stay in step), packed
    as padded."""
    items = _samples()
    for it in items:
        it["loss_mask"][:] = False
    for batch in (collate(items), pack(items)):
        loss, stats, grads = _step(batch, distill=False)
        assert float(loss) == 0.0 and int(stats["tokens"]) == 0
        assert all(float(g.abs().max()) == 0.0 for g in grads.values())
