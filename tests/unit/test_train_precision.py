"""train.precision: the bf16 copy of float32 masters (the CUDA default) computes the step autocast computed.

Both run here on CPU (autocast on CPU in bfloat16): one step's loss and every master gradient are compared with
each other and with float32, and the copy is checked to be the masters rounded to bfloat16 after each step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dflash_pipeline.drafter.batching import block_inputs, block_loss, sample_anchors
from dflash_pipeline.drafter.model import DFlashDrafter, DraftSpec
from dflash_pipeline.drafter.precision import ComputeCopy, autocast, compute_dtype, resolve
from dflash_pipeline.errors import ConfigError

torch.set_num_threads(1)
CPU = torch.device("cpu")
SPEC = DraftSpec(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=211,
    target_layer_ids=[1, 2, 3],
    num_target_layers=4,
    block_size=8,
    mask_token_id=210,
)


def _batch(t: int = 40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 210, (2, t), generator=g)
    mask = torch.ones(2, t, dtype=torch.bool)
    mask[:, :5] = False
    anchors, keep = sample_anchors(mask, 6, torch.Generator().manual_seed(2))
    blk = block_inputs(ids, mask, anchors, keep, SPEC.block_size, SPEC.mask_token_id, 7.0)
    ctx = torch.randn(2, t, 3 * 64, generator=g) * 2
    embed = torch.randn(211, 64, generator=g)
    head = torch.randn(211, 64, generator=g) * 0.2
    return ctx, anchors, keep, blk, embed, head


def one_step(precision: str):
    """(loss, master gradients, the model pair) of one training step as drafter/train.py takes it."""
    ctx, anchors, keep, blk, embed, head = _batch()
    torch.manual_seed(0)
    master = DFlashDrafter(SPEC)
    work = ComputeCopy(master, precision)
    dt = compute_dtype(precision)
    lm_head = nn.Linear(64, 211, bias=False)
    lm_head.weight.data = head.to(dt)
    t = ctx.shape[1]
    with autocast(precision, CPU):
        out = work.module(
            ctx.to(dt),
            embed.to(dt)[blk["block_ids"]],
            torch.arange(t).expand(2, t),
            blk["block_pos"],
            master.block_masks(anchors, keep, t),
        )
        loss, _ = block_loss(out, SimpleNamespace(lm_head=lm_head), blk)
    loss.backward()
    work.fold_grads()
    return loss.detach().double(), [p.grad.double() for p in master.parameters()], master, work


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_bf16_copy_step_equals_the_autocast_step():
    loss32, grads32, _, _ = one_step("fp32")
    loss_ac, grads_ac, _, _ = one_step("autocast")
    loss_bf, grads_bf, master, work = one_step("bf16")
    assert all(p.dtype == torch.float32 for p in master.parameters())
    assert all(p.dtype == torch.bfloat16 for p in work.module.parameters())
    assert all(p.grad is None for p in work.module.parameters())  # folded into the masters
    # the loss within bfloat16 rounding of autocast's (and of float32's)
    assert _rel(loss_bf, loss_ac) < 1e-3 and _rel(loss_bf, loss32) < 1e-3
    for name, g32, gac, gbf in zip([n for n, _ in master.named_parameters()], grads32, grads_ac, grads_bf):
        assert _rel(gbf, gac) < 1e-2, name  # measured: <= 0.5%
        # as close to float32 as autocast is (the same weights rounded, activations rounded in other places)
        assert _rel(gbf, g32) < 1.25 * _rel(gac, g32) + 2e-3, name  # both ~1% from float32


def test_the_copy_is_the_masters_rounded_after_an_optimizer_step():
    _, _, master, work = one_step("bf16")
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    opt.step()
    before = [c.detach().clone() for c in work.module.parameters()]
    work.refresh()
    for m, c in zip(master.parameters(), work.module.parameters()):
        assert torch.equal(c, m.detach().to(torch.bfloat16))
    assert any(not torch.equal(c, b) for c, b in zip(work.module.parameters(), before))  # the step moved them


def test_precision_resolves_per_device():
    assert resolve("auto", torch.device("cpu")) == "fp32"
    assert resolve("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve("autocast", CPU) == "autocast"
    with pytest.raises(ConfigError, match="train.precision='half'"):
        resolve("half", CPU)
