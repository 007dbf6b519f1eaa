"""The chunked lm_head loss (drafter/head_loss.py) equals plain autograd over all logits, loss and gradient."""

import pytest
import torch
import torch.nn.functional as F

from dflash_pipeline.drafter.head_loss import head_loss


def reference_head_loss(h, weight, labels, weights, target_logits=None):
    """Plain autograd over all logits at once (float32 at least): what head_loss must equal."""
    logits = h.to(weight.dtype) @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = F.log_softmax(logits, dim=-1)
    if target_logits is None:
        per = -logp.gather(1, labels[:, None]).squeeze(1)
    else:
        t = target_logits(slice(None))
        tlogp = F.log_softmax(t.to(torch.promote_types(t.dtype, torch.float32)), dim=-1)
        per = (tlogp.exp() * (tlogp - logp)).sum(-1)
    return (per * weights).sum() / weights.sum(), (logits.argmax(-1) == labels).sum()


@pytest.mark.parametrize("distill", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
def test_chunked_head_loss_equals_autograd(distill, rows):
    g = torch.Generator().manual_seed(rows + 10 * distill)
    n, hid, vocab = 23, 16, 97
    h = torch.randn(n, hid, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[:5] = (h[:5] @ weight.t()).argmax(-1)  # some rows right, so `correct` is not trivially 0
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    weights[::4] = 0.0
    last = torch.randn(n, hid, generator=g, dtype=torch.float64)
    target = (lambda s: last[s] @ weight.t()) if distill else None

    h1 = h.clone().requires_grad_(True)
    loss1, correct1 = head_loss(h1, weight, labels, weights, target, rows=rows)
    (loss1 * 0.37).backward()  # a scale, as gradient accumulation applies
    h2 = h.clone().requires_grad_(True)
    loss2, correct2 = reference_head_loss(h2, weight, labels, weights, target)
    (loss2 * 0.37).backward()

    assert int(correct1) == int(correct2) >= 5
    torch.testing.assert_close(loss1, loss2, rtol=1e-12, atol=0)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    assert h1.grad[::4].abs().max() == 0  # zero-weight rows get no gradient


def test_head_loss_without_grad_and_weight_untouched():
    weight = torch.randn(11, 4, requires_grad=False)
    h = torch.randn(5, 4)
    loss, correct = head_loss(h, weight, torch.zeros(5, dtype=torch.long), torch.ones(5))
    ref, _ = reference_head_loss(h, weight, torch.zeros(5, dtype=torch.long), torch.ones(5))
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ce_chunk_equals_eager(dtype):
    """train.compile=pointwise fuses the loss's per-chunk softmax (head_loss.compile_chunk, the CUDA default): the
    same loss, hits and logits gradient as the eager chunk, over two chunk lengths (dynamic shapes), bf16 included
    (the training dtype on GPUs; the gradient is rounded to it once, as the eager chunk does)."""
    from dflash_pipeline.drafter.head_loss import ce_chunk

    compiled = torch.compile(ce_chunk, dynamic=True)
    for rows in (7, 12):
        g = torch.Generator().manual_seed(rows)
        logits = (torch.randn(rows, 301, generator=g) * 4).to(dtype)
        labels = torch.randint(0, 301, (rows,), generator=g)
        labels[:3] = logits[:3].float().argmax(-1)
        wn = torch.rand(rows, generator=g)
        wn[1] = 0.0
        want, got = ce_chunk(logits, labels, wn), compiled(logits, labels, wn)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert int(got[1]) == int(want[1]) >= 3
        assert got[2].dtype == dtype
        tol = {"rtol": 1.6e-2, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(got[2], want[2], **tol)
        assert got[2][1].abs().max() == 0
