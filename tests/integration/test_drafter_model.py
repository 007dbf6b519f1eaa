"""The drafter's export format, checked against a forward written here from the documented format only
(config.json + safetensors tensors, plain torch ops), and the block-attention semantics."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from dflash_pipeline.drafter.export import export_drafter, load_drafter
from dflash_pipeline.drafter.model import FULL, SLIDING, DFlashDrafter, DraftSpec

torch.set_num_threads(1)


def _spec(layer_types=None, window=None) -> DraftSpec:
    return DraftSpec(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        vocab_size=50,
        target_layer_ids=[0, 2, 3],
        num_target_layers=4,
        block_size=6,
        mask_token_id=49,
        rope_theta=10000.0,
        sliding_window=window,
        layer_types=layer_types or [],
    )


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # norms too, so a wrong norm formula shows
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 1.0) + (1.0 if p.ndim == 1 else 0.0))


def reference_forward(cfg: dict, w: dict, ctx: torch.Tensor, emb: torch.Tensor, anchor: int) -> torch.Tensor:
    """One block. ctx [S, K*H] target features of positions 0..S-1, emb [bs, H] block embeddings at
    positions anchor..anchor+bs-1. Written from the format in drafter/export.py's docstring."""
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg["rope_parameters"]["rope_theta"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]

    def rms(x, weight):
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rot(x, positions):  # x [L, heads, hd]; pairs (j, j + hd/2) rotated by p * theta^(-2j/hd)
        out = x.clone()
        for li, p in enumerate(positions):
            for j in range(hd // 2):
                a = p * theta ** (-2 * j / hd)
                c, s = math.cos(a), math.sin(a)
                x1, x2 = x[li, :, j], x[li, :, j + hd // 2]
                out[li, :, j], out[li, :, j + hd // 2] = x1 * c - x2 * s, x2 * c + x1 * s
        return out

    s_len, bs = ctx.shape[0], emb.shape[0]
    c = rms(ctx @ w["fc.weight"].T, w["hidden_norm.weight"])
    qpos = [anchor + i for i in range(bs)]
    kpos = list(range(s_len)) + qpos
    h = emb
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(bs, nh, hd), w[p + "self_attn.q_norm.weight"])
        kv_in = torch.cat([c, x])
        k = rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"])
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = rot(q, qpos), rot(k, kpos)
        attn = torch.zeros(bs, nh, hd, dtype=h.dtype)
        for qi in range(bs):
            for head in range(nh):
                kh = head // (nh // nkv)
                allowed = []
                for kj in range(len(kpos)):
                    ok = kj < anchor if kj < s_len else True  # context strictly before the anchor
                    if types[i] == "sliding_attention":
                        ok = ok and kpos[kj] <= qpos[qi] and qpos[qi] - kpos[kj] < cfg["sliding_window"]
                    allowed.append(ok)
                sc = torch.stack(
                    [
                        q[qi, head] @ k[kj, kh] / math.sqrt(hd)
                        if allowed[kj]
                        else torch.tensor(-math.inf, dtype=h.dtype)
                        for kj in range(len(kpos))
                    ]
                )
                attn[qi, head] = torch.softmax(sc, 0) @ v[:, kh]
        h = h + attn.reshape(bs, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])


@pytest.mark.parametrize(("types", "window"), [(None, None), ([FULL, SLIDING], 7)])
def test_export_matches_independent_forward(tmp_path, types, window):
    model = DFlashDrafter(_spec(types, window))
    _randomize(model)
    out = export_drafter(model, tmp_path / "export", {"note": "test"}, dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 4 and cfg["block_size"] == 6
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2, 3] and cfg["dflash_config"]["mask_token_id"] == 49
    assert ("layer_types" in cfg) == (types is not None)
    w = {k: v.double() for k, v in load_file(str(out / "model.safetensors")).items()}
    assert not any("embed" in k or "lm_head" in k for k in w)

    g = torch.Generator().manual_seed(1)
    s_len, anchors = 12, [3, 9, 12]
    ctx = torch.randn(1, s_len, 3 * 32, generator=g, dtype=torch.float64)
    emb = torch.randn(1, len(anchors) * 6, 32, generator=g, dtype=torch.float64)
    a = torch.tensor([anchors])
    block_pos = (a[:, :, None] + torch.arange(6)).reshape(1, -1)
    reloaded = load_drafter(out, dtype=torch.float64)
    with torch.no_grad():
        got = reloaded(ctx, emb, torch.arange(s_len)[None], block_pos, reloaded.block_masks(a, None, s_len))
        orig = model.double()(ctx, emb, torch.arange(s_len)[None], block_pos, model.block_masks(a, None, s_len))
    assert torch.equal(got, orig)  # reload is exact
    for n, anchor in enumerate(anchors):  # several blocks in one forward == each block alone
        ref = reference_forward(cfg, w, ctx[0], emb[0, n * 6 : (n + 1) * 6], anchor)
        torch.testing.assert_close(got[0, n * 6 : (n + 1) * 6], ref, rtol=1e-9, atol=1e-9)


def test_block_sees_only_context_before_anchor():
    model = DFlashDrafter(_spec()).eval()
    g = torch.Generator().manual_seed(2)
    ctx = torch.randn(1, 10, 96, generator=g)
    emb = torch.randn(1, 6, 32, generator=g)
    a = torch.tensor([[5]])
    run = lambda c: model(c, emb, torch.arange(10)[None], 5 + torch.arange(6)[None], model.block_masks(a, None, 10))
    with torch.no_grad():
        base = run(ctx)
        later = ctx.clone()
        later[:, 5:] += 1.0  # the anchor's own and later positions: invisible
        assert torch.equal(run(later), base)
        earlier = ctx.clone()
        earlier[:, 4] += 1.0
        assert not torch.allclose(run(earlier), base)


def test_compiled_pointwise_equals_eager():
    """train.compile=pointwise (the CUDA default) computes the same forward and gradients as the eager layers,
    across two context lengths (dynamic shapes: no recompilation per length)."""
    from dflash_pipeline.drafter.model import POINTWISE, compile_pointwise, eager_pointwise, rms_norm

    model = DFlashDrafter(_spec())
    _randomize(model)
    g = torch.Generator().manual_seed(3)

    def loss_and_grads(s_len: int) -> list[torch.Tensor]:
        ctx = torch.randn(1, s_len, 96, generator=torch.Generator().manual_seed(s_len))
        emb = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(s_len + 1))
        a = torch.tensor([[3, s_len - 2]])
        pos = (a[:, :, None] + torch.arange(6)).reshape(1, -1)
        model.zero_grad()
        out = model(ctx, emb, torch.arange(s_len)[None], pos, model.block_masks(a, None, s_len))
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        return [out.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = [loss_and_grads(n) for n in (10, 17)]
    g.manual_seed(3)
    compile_pointwise()
    try:
        assert POINTWISE.rms_norm is not rms_norm
        compiled = [loss_and_grads(n) for n in (10, 17)]
    finally:
        eager_pointwise()
    assert POINTWISE.rms_norm is rms_norm
    for e, c in zip(eager, compiled):
        for x, y in zip(e, c):
            torch.testing.assert_close(y, x, rtol=2e-3, atol=1e-4)  # float32, fused: other summation order
