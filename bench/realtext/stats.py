"""Hidden-state statistics per decoder layer, the way Sun et al. 2024 ("Massive Activations in Large Language Models",
arXiv 2402.17762) look at them: the largest activation magnitudes against the median magnitude, and which tokens and
feature dimensions carry the largest ones.

The value of layer i is its output (the residual stream after layer i, before the final norm: what the pipeline
stores for layer id i), captured with forward hooks, in the model's own dtype.
"""

from __future__ import annotations

import torch


def _out(o):
    return o[0] if isinstance(o, tuple) else o


@torch.inference_mode()
def layer_outputs(model, ids: list[int]) -> list[torch.Tensor]:
    """Every decoder layer's output for one sequence, [T, H] each (float32 copies)."""
    layers = model.model.layers
    got: list[torch.Tensor | None] = [None] * len(layers)
    hooks = [
        layer.register_forward_hook(lambda _m, _i, o, k=k: got.__setitem__(k, _out(o)[0].float()))
        for k, layer in enumerate(layers)
    ]
    try:
        dev = next(model.parameters()).device
        model(input_ids=torch.tensor([ids], device=dev), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [g for g in got if g is not None]


def activation_stats(model, sequences: list[list[int]], tokenizer, top: int = 10, massive_ratio: float = 100.0):
    """Per layer over all tokens of `sequences`: top-`top` magnitudes with (sequence, position, channel, token), the
    median magnitude, top1/median, the share of tokens whose largest channel exceeds `massive_ratio` x the median
    (the 'massive' tokens), how many of the top-`top` sit at position 0, and the channels they sit in."""
    per_layer: list[list[torch.Tensor]] = []
    for ids in sequences:
        for k, h in enumerate(layer_outputs(model, ids)):
            if len(per_layer) <= k:
                per_layer.append([])
            per_layer[k].append(h)
    out = []
    for k, hs in enumerate(per_layer):
        lengths = [h.shape[0] for h in hs]
        a = torch.cat(hs).abs()  # [N, H]
        n, width = a.shape
        median = float(a.flatten().float().median())
        vals, idx = a.flatten().topk(top)
        rows, chans = (idx // width).tolist(), (idx % width).tolist()
        tops = []
        for v, r, c in zip(vals.tolist(), rows, chans, strict=True):
            seq, pos = _locate(r, lengths)
            tok = sequences[seq][pos]
            tops.append({"value": round(v, 3), "seq": seq, "pos": pos, "channel": c, "token": tokenizer.decode([tok])})
        tok_max = a.max(dim=1).values
        massive = tok_max > massive_ratio * median
        m_rows = massive.nonzero().flatten().tolist()
        m_tokens: dict[str, int] = {}
        m_first = 0
        for r in m_rows:
            seq, pos = _locate(r, lengths)
            m_first += pos == 0
            t = tokenizer.decode([sequences[seq][pos]])
            m_tokens[t] = m_tokens.get(t, 0) + 1
        out.append(
            {
                "layer": k,
                "top": tops,
                "top1": tops[0]["value"],
                "median": median,
                "top1_over_median": tops[0]["value"] / max(median, 1e-12),
                "tokens": n,
                "massive_tokens": len(m_rows),
                "massive_share": len(m_rows) / n,
                "massive_at_pos0": m_first,
                "massive_token_texts": dict(sorted(m_tokens.items(), key=lambda kv: -kv[1])[:8]),
                "top_at_pos0": sum(t["pos"] == 0 for t in tops),
                "top_channels": sorted({t["channel"] for t in tops}),
                "rms": float(a.pow(2).mean().sqrt()),
            }
        )
    return out


def _locate(row: int, lengths: list[int]) -> tuple[int, int]:
    for seq, n in enumerate(lengths):
        if row < n:
            return seq, row
        row -= n
    raise IndexError(row)


def table(stats: list[dict], title: str) -> str:
    lines = [
        f"{title}",
        "layer   top1     median   top1/med  massive tokens (>100x med)  top-10 at pos 0  top channels  top token",
    ]
    for s in stats:
        lines.append(
            f"{s['layer']:>5} {s['top1']:>8.2f} {s['median']:>9.4f} {s['top1_over_median']:>9.0f}"
            f"  {s['massive_tokens']:>6} ({s['massive_share']:.4f})          {s['top_at_pos0']:>2}/10"
            f"           {str(s['top_channels'][:4]):<13} {s['top'][0]['token']!r}"
        )
    return "\n".join(lines)
