"""Training batches: padding, anchor sampling, block construction and the block loss.

An anchor `a` is valid when the token after it is supervised (loss_mask[a+1]): the block then predicts
data tokens. This includes the token just before an assistant span (the generation prompt's last
token), because at serving time that is exactly the anchor of the first draft. Padding is on the right,
so a block's context (positions < anchor) never contains padding.
"""

from __future__ import annotations

import math

import torch

from dflash_pipeline.drafter.head_loss import head_loss


def collate(items: list[dict]) -> dict:
    """Right-pad a list of store samples. hidden [T, K, H] becomes [B, T, K*H] (layer_ids order)."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    b, t = len(items), int(lengths.max())
    k, h = items[0]["hidden"].shape[1:]
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "hidden": torch.zeros(b, t, k * h, dtype=items[0]["hidden"].dtype),
        "lengths": lengths,
    }
    has_last = all("last_hidden" in it for it in items)
    if has_last:
        out["last_hidden"] = torch.zeros(b, t, h, dtype=items[0]["last_hidden"].dtype)
    # A compact store read with dequantize=False: the rows' scales (padding gets scale 0, so it stays 0).
    scales = [s for s in ("hidden_scale", "last_hidden_scale") if s in items[0] and (has_last or s == "hidden_scale")]
    for s in scales:
        out[s] = torch.zeros(b, t, *items[0][s].shape[1:], dtype=items[0][s].dtype)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        out["input_ids"][i, :n] = it["input_ids"]
        out["loss_mask"][i, :n] = it["loss_mask"]
        out["hidden"][i, :n] = it["hidden"].reshape(n, k * h)
        if has_last:
            out["last_hidden"][i, :n] = it["last_hidden"]
        for s in scales:
            out[s][i, :n] = it[s]
    return out


def states(batch: dict, name: str, precision: str, logical: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """batch[name] ('hidden' [B, T, K*H] or 'last_hidden' [B, T, H]) in `dtype`. A compact store's stored values
    are dequantized here, where the batch is (on the GPU in training), with batch[name + '_scale'], into the
    store's logical dtype first: exactly the values HiddenStateDataset returns when it dequantizes."""
    x, scale = batch[name], batch.get(f"{name}_scale")
    if scale is None:
        return x.to(dtype)
    from dflash_pipeline.storage.quant import dequantize

    if name == "hidden":  # [B, T, K*H'] with scales [B, T, K, ...] (H' = H, or H/2 for int4)
        bsz, t, kh = x.shape
        k = scale.shape[2]
        return dequantize(x.view(bsz, t, k, kh // k), scale, precision, logical).view(bsz, t, -1).to(dtype)
    return dequantize(x, scale, precision, logical).to(dtype)


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [B, N] (sorted per row) and keep [B, N]; N = min(max_anchors, most valid anchors in a row),
    at least 1 (an all-dropped row keeps the graph identical across DDP ranks; its loss weight is 0)."""
    valid = torch.zeros_like(loss_mask)
    valid[:, :-1] = loss_mask[:, 1:]
    rows = [v.nonzero().flatten() for v in valid.cpu()]
    n = max(1, min(max_anchors, max(len(r) for r in rows)))
    anchors = torch.zeros(len(rows), n, dtype=torch.long)
    keep = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        pick = r[torch.randperm(len(r), generator=gen)[:n]].sort().values
        anchors[i, : len(pick)], keep[i, : len(pick)] = pick, True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[bs]: 0 for the anchor (position 0), exp(-(k-1)/gamma) for k >= 1 (1 when gamma is None)."""
    w = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) if gamma else 1.0 for k in range(1, block_size)])
    return w


def block_inputs(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_id: int,
    gamma: float | None,
) -> dict:
    """block_ids / block_pos [B, N*bs]; labels, label_pos, weights [B, N, bs] (label k = token a+k)."""
    b, t = input_ids.shape
    off = torch.arange(block_size, device=input_ids.device)
    label_pos = anchors[:, :, None] + off  # [B, N, bs]
    inside = label_pos < t
    safe = label_pos.clamp(max=t - 1)
    labels = torch.gather(input_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, safe)
    supervised = torch.gather(loss_mask[:, None, :].expand(-1, anchors.shape[1], -1), 2, safe)
    w = position_weights(block_size, gamma).to(input_ids.device)
    weights = w * (inside & supervised & keep[:, :, None]).float()
    block_ids = torch.full_like(labels, mask_id)
    block_ids[:, :, 0] = torch.where(keep, labels[:, :, 0], torch.full_like(labels[:, :, 0], mask_id))
    return {
        "block_ids": block_ids.reshape(b, -1),
        "block_pos": label_pos.reshape(b, -1),
        "labels": labels,
        "label_pos": safe,
        "weights": weights,
    }


def block_loss(
    out: torch.Tensor, head, blk: dict, last_hidden: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """Weighted mean over supervised block positions of CE(data token) or, with last_hidden, of
    KL(target || draft) where the target's distribution for token a+k comes from position a+k-1.

    Only supervised positions go through lm_head, a chunk at a time (drafter/head_loss.py). The statistics
    are tensors on the loss's device, so a step needs no host synchronisation for them."""
    w = blk["weights"].reshape(-1)
    sel = (w > 0).nonzero().flatten()
    if sel.numel() == 0:  # keep the graph (DDP) with a zero loss
        zero = torch.zeros((), dtype=torch.long, device=out.device)
        return out.sum() * 0.0, {"tokens": zero, "correct": zero}
    h = out.reshape(-1, out.shape[-1])[sel]
    labels = blk["labels"].reshape(-1)[sel]
    target = None
    if last_hidden is not None:
        b = last_hidden.shape[0]
        row = torch.arange(b, device=sel.device)[:, None, None].expand_as(blk["label_pos"]).reshape(-1)[sel]
        src = (blk["label_pos"].reshape(-1)[sel] - 1).clamp(min=0)

        def target(rows: slice) -> torch.Tensor:
            return head.target_logits(last_hidden[row[rows], src[rows]])

    loss, correct = head_loss(h, head.lm_head.weight, labels, w[sel], target)
    return loss, {"tokens": torch.full((), sel.numel(), device=out.device), "correct": correct}
