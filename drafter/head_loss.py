"""The loss through the target's frozen lm_head, a chunk of rows at a time, with its gradient computed on the way.

The vocabulary projection dominates training memory and much of its time: for an 8B target, 7,680
supervised block positions x 151,936 tokens is 4.7 GB of float32 logits, and autograd keeps the logits, their
log-softmax and their gradient alive at once. Here each chunk of rows is projected, reduced to its loss, and
turned at once into the gradient with respect to the draft hidden states (dL/dh = (p - q) W, p the draft
distribution, q the one-hot label or the target's distribution), so only one chunk's logits ever exist and
the backward pass is a multiplication by the incoming gradient. Two matrix products per row (the forward and
the input gradient; the head is frozen, so no weight gradient), as autograd would do, not three as
recomputation in the backward would.

The result equals `-log_softmax(h W^T)[label]` (or KL(target || draft)) weighted and averaged, with its gradient:
tests/unit/test_head_loss.py compares it with plain autograd in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_BYTES = 512 * 2**20  # float32 logits of one chunk


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float32 for bf16/fp16/fp32 logits; float64 stays float64 (the tests' exact reference)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, wn: torch.Tensor):
    """One chunk of the cross-entropy: (sum of wn * CE, rows whose argmax is the label, dL/dlogits in the logits'
    dtype). Written as one expression over the chunk so that torch.compile (`compile_chunk`) fuses it into a
    couple of passes over the bf16 logits, instead of eager's float32 copy, log-softmax, argmax, exp, scatter and
    scale, each a pass over [rows, vocab] float32 (~10% of a training step's GPU time, measured on an H200)."""
    x = _wide(logits)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    correct = (x.argmax(-1) == labels).sum()
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    g = (torch.exp(x - lse[:, None]) - hit.to(x.dtype)) * wn[:, None]
    return ((lse - picked) * wn).sum(), correct, g.to(logits.dtype)


def ce_rows(logits: torch.Tensor, labels: torch.Tensor):
    """One chunk of the cross-entropy row by row, for weights that depend on it (D-PACE): (CE of each row, rows
    whose argmax is the label, the unweighted dL/dlogits in the logits' dtype)."""
    x = _wide(logits)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    correct = (x.argmax(-1) == labels).sum()
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    return lse - picked, correct, (torch.exp(x - lse[:, None]) - hit.to(x.dtype)).to(logits.dtype)


_CHUNK = {"ce": ce_chunk}


def compile_chunk(enabled: bool) -> None:
    """Swap in (or out) a torch.compile'd `ce_chunk` with dynamic shapes (the last chunk of a step is shorter);
    train.compile=pointwise does this with the draft layers' element-wise parts (drafter.model.compile_pointwise)."""
    if not enabled:
        _CHUNK["ce"] = ce_chunk
    elif _CHUNK["ce"] is ce_chunk:
        _CHUNK["ce"] = torch.compile(ce_chunk, dynamic=True)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, wn, target_logits, rows, reweight):
        loss = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=h.device)
        correct = torch.zeros((), dtype=torch.long, device=h.device)
        grad = torch.empty_like(h) if h.requires_grad else None
        ce = torch.empty(h.shape[0], dtype=loss.dtype, device=h.device) if reweight is not None else None
        for i in range(0, h.shape[0], rows):
            s = slice(i, i + rows)
            logits = h[s].to(weight.dtype) @ weight.t()
            lab = labels[s]
            if ce is not None:  # weights from the loss itself: rows unweighted now, scaled once all are known
                ce[s], hits, g = ce_rows(logits, lab)
                part = 0.0
                del logits
            elif target_logits is None:
                part, hits, g = _CHUNK["ce"](logits, lab, wn[s])
                del logits
            else:
                logits = _wide(logits)
                logp = torch.log_softmax(logits, dim=-1)
                hits = (logits.argmax(-1) == lab).sum()
                del logits
                with torch.no_grad():
                    tlogp = torch.log_softmax(_wide(target_logits(s)), dim=-1)
                q = tlogp.exp()
                part = ((q * (tlogp - logp)).sum(-1) * wn[s]).sum()
                del tlogp
                g = logp.exp_()  # the draft distribution p, in place of logp
                g -= q
                g *= wn[s, None]
            loss += part
            correct += hits
            if grad is not None:
                grad[s] = (g.to(weight.dtype) @ weight).to(h.dtype)
        if ce is not None:
            w = reweight(ce)
            wn = w / w.sum()
            loss = (ce * wn).sum()
            if grad is not None:
                grad.mul_(wn[:, None].to(grad.dtype))
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


def head_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    target_logits: Callable[[slice], torch.Tensor] | None = None,
    rows: int | None = None,
    reweight: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean loss, number of rows whose argmax is the label) for draft hidden states h [N, H].

    `weight` [V, H]: the frozen lm_head; `labels` [N]; `weights` [N] (>= 0, not all 0). With `target_logits`
    (a function of a row slice giving the target's logits of those rows) the loss is KL(target || draft);
    without it, cross-entropy on the labels. `rows`: rows per chunk (default: ~512 MiB of float32 logits).
    `reweight` (cross-entropy only): a function of every row's detached cross-entropy [N] giving the rows' weights
    in place of `weights` (D-PACE, drafter/levers.py); the rows' gradients are scaled once all are known."""
    if reweight is not None and target_logits is not None:
        raise ValueError("loss weights from the cross-entropy (D-PACE) apply to cross-entropy, not distillation")
    wn = _wide(weights / weights.sum())
    rows = rows or chunk_rows(weight.shape[0])
    return _HeadLoss.apply(h, weight.detach(), labels, wn, target_logits, rows, reweight)
