"""Training batches: padding, anchor sampling, block construction and the block loss.

An anchor `a` is valid when the token after it is supervised (loss_mask[a+1]): the block then predicts
data tokens. This includes the token just before an assistant span (the generation prompt's last
token), because at serving time that is exactly the anchor of the first draft. Padding is on the right,
so a block's context (positions < anchor) never contains padding.

Packed (train.pack): the micro-batch's samples lie one after another in a single row, `starts` marks where each
begins, positions restart at 0 in each, and a block sees only its own sample's context (the segment from its
sample's start to its anchor) and predicts only inside its sample: the anchors, labels and loss of the padded
batch, with no padding computed.
"""

from __future__ import annotations

import math

import torch

from dflash_pipeline.drafter.head_loss import head_loss
from dflash_pipeline.drafter.levers import dpace_weights


def _optional_fields(items: list[dict]) -> list[str]:
    """The per-token fields beyond input_ids, loss_mask and hidden that a batch of `items` carries: last_hidden when
    every item has it, and a compact store's scales (read with dequantize=False) of the states it carries."""
    has_last = all("last_hidden" in it for it in items)
    names = ("last_hidden", "hidden_scale", "last_hidden_scale")
    return [n for n in names if n in items[0] and (has_last or n == "hidden_scale")]


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
    optional = _optional_fields(items)  # padding gets scale 0, so it stays 0
    for name in optional:
        out[name] = torch.zeros(b, t, *items[0][name].shape[1:], dtype=items[0][name].dtype)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        out["input_ids"][i, :n] = it["input_ids"]
        out["loss_mask"][i, :n] = it["loss_mask"]
        out["hidden"][i, :n] = it["hidden"].reshape(n, k * h)
        for name in optional:
            out[name][i, :n] = it[name]
    return out


def pack(items: list[dict]) -> dict:
    """The samples of `items` one after another in one row: input_ids, loss_mask [1, sum T], hidden [1, sum T, K*H]
    (and the optional fields), 'positions' [1, sum T] (each sample's own, from 0), 'starts' [S] (each sample's first
    position in the row) and 'lengths' [S]."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    out = {"lengths": lengths, "starts": torch.cumsum(lengths, 0) - lengths}
    out["positions"] = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    out["input_ids"] = torch.cat([it["input_ids"] for it in items])[None].long()
    out["loss_mask"] = torch.cat([it["loss_mask"] for it in items])[None].bool()
    out["hidden"] = torch.cat([it["hidden"].reshape(len(it["input_ids"]), -1) for it in items])[None]
    for name in _optional_fields(items):
        out[name] = torch.cat([it[name] for it in items])[None]
    return out


def segment_bounds(anchors: torch.Tensor, starts: torch.Tensor | None, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) [B, N]: the row positions where each anchor's sample begins and one past where it ends; a padded
    batch (`starts` None) has one sample per row: (0, t)."""
    if starts is None:
        return torch.zeros_like(anchors), torch.full_like(anchors, t)
    starts = starts.to(anchors.device)
    seg = torch.searchsorted(starts, anchors, right=True) - 1
    ends = torch.cat([starts[1:], starts.new_tensor([t])])
    return starts[seg], ends[seg]


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
    loss_mask: torch.Tensor, max_anchors: int, gen: torch.Generator, starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """anchors [B, N] (sorted per row) and keep [B, N]; N = min(max_anchors, most valid anchors in a row),
    at least 1 (an all-dropped row keeps the graph identical across DDP ranks; its loss weight is 0).

    A packed row (`starts`: its samples' first positions) gets, sample by sample, exactly the anchors that sample
    gets as a row of the padded batch (the same draws from `gen`), one after another: N = their total."""
    valid = torch.zeros_like(loss_mask)
    valid[:, :-1] = loss_mask[:, 1:]
    if starts is not None:
        assert loss_mask.shape[0] == 1, "a packed micro-batch is one row"
        valid[0, starts[1:] - 1] = False  # a sample's last token: the next token is another sample's
        return _packed_anchors(valid[0].cpu(), max_anchors, gen, starts.cpu(), loss_mask.device)
    rows = [v.nonzero().flatten() for v in valid.cpu()]
    n = max(1, min(max_anchors, max(len(r) for r in rows)))
    anchors = torch.zeros(len(rows), n, dtype=torch.long)
    keep = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        pick = r[torch.randperm(len(r), generator=gen)[:n]].sort().values
        anchors[i, : len(pick)], keep[i, : len(pick)] = pick, True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def _packed_anchors(valid: torch.Tensor, max_anchors: int, gen: torch.Generator, starts: torch.Tensor, device):
    bounds = [*starts.tolist(), len(valid)]
    picks = []
    for first, end in zip(bounds[:-1], bounds[1:]):
        r = first + valid[first:end].nonzero().flatten()
        picks.append(r[torch.randperm(len(r), generator=gen)[:max_anchors]].sort().values)
    anchors = torch.cat(picks)
    keep = torch.ones(len(anchors), dtype=torch.bool)
    if len(anchors) == 0:  # nothing supervised: one dropped block (see above)
        anchors, keep = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool)
    return anchors[None].to(device), keep[None].to(device)


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
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """block_ids / block_pos [B, N*bs]; labels, label_pos, weights [B, N, bs] (label k = token a+k).
    `bounds` (segment_bounds; None = one sample per row): block_pos counts from the anchor's sample's start, and a
    block predicts nothing past its sample's end."""
    b, t = input_ids.shape
    first, end = bounds if bounds is not None else segment_bounds(anchors, None, t)
    off = torch.arange(block_size, device=input_ids.device)
    label_pos = anchors[:, :, None] + off  # [B, N, bs]
    inside = label_pos < end[:, :, None]
    safe = label_pos.clamp(max=t - 1)
    labels = torch.gather(input_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, safe)
    supervised = torch.gather(loss_mask[:, None, :].expand(-1, anchors.shape[1], -1), 2, safe)
    w = position_weights(block_size, gamma).to(input_ids.device)
    weights = w * (inside & supervised & keep[:, :, None]).float()
    block_ids = torch.full_like(labels, mask_id)
    block_ids[:, :, 0] = torch.where(keep, labels[:, :, 0], torch.full_like(labels[:, :, 0], mask_id))
    return {
        "block_ids": block_ids.reshape(b, -1),
        "block_pos": (label_pos - first[:, :, None]).reshape(b, -1),
        "labels": labels,
        "label_pos": safe,
        "weights": weights,
    }


def block_loss(
    out: torch.Tensor, head, blk: dict, last_hidden: torch.Tensor | None = None, dpace_alpha: float | None = None
) -> tuple[torch.Tensor, dict]:
    """Weighted mean over supervised block positions of CE(data token) or, with last_hidden, of
    KL(target || draft) where the target's distribution for token a+k comes from position a+k-1. With
    `dpace_alpha` the positions' weights are D-PACE's (drafter/levers.py) in place of the fixed decay.

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

    reweight = None
    if dpace_alpha is not None:
        supervised = (blk["weights"] > 0).reshape(-1, blk["weights"].shape[-1])

        def reweight(ce: torch.Tensor) -> torch.Tensor:
            full = torch.zeros(supervised.numel(), dtype=ce.dtype, device=ce.device)
            full[sel] = ce
            return dpace_weights(full.reshape(supervised.shape), supervised, dpace_alpha).reshape(-1)[sel]

    loss, correct = head_loss(h, head.lm_head.weight, labels, w[sel], target, reweight=reweight)
    return loss, {"tokens": torch.full((), sel.numel(), device=out.device), "correct": correct}
