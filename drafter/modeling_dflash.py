"""DFlash draft model for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.

Shipped inside every drafter export (drafter/export.py copies this file there and points config.json's
`auto_map` at it), so it must stay self-contained: torch and transformers only, nothing of dflash_pipeline.
It computes exactly what dflash_pipeline.drafter.model.DFlashDrafter computes (tests/integration/
test_drafter_model.py compares the two on the same export).

forward(target_hidden [B, S, K*H], noise_embedding [B, Q, H], position_ids [B, S+Q], attention_mask=None)
-> hidden states [B, Q, H] after the final norm (apply the target's lm_head for logits). `target_hidden`:
the target's hidden states of the context, the layers `config.dflash_config["target_layer_ids"]` (output of
decoder layer i, before any final norm) concatenated along the hidden axis; `noise_embedding`: the target's
token embedding of one block (the last accepted token followed by block_size-1 mask tokens,
`dflash_config["mask_token_id"]`); `position_ids`: positions of the context then of the block. Without a
mask the block sees the whole context and itself (bidirectional; sliding-window layers: causal inside the
block, within the window). `attention_mask`: a bool [B, 1, Q, S+Q] (True = attend) for every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

FULL, SLIDING = "full_attention", "sliding_attention"


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    dtype = torch.promote_types(dtype, torch.float32)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=dtype) / head_dim))
    ang = pos.to(dtype)[:, None, :, None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return (x.to(cos.dtype) * cos + rotated.to(cos.dtype) * sin).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.hd, self.nh, self.nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = DFlashRMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        b, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.nkv, self.hd).transpose(1, 2)
        q, k = _apply_rope(q, *q_rope), _apply_rope(k, *kv_rope)
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.nh * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = DFlashMLP(c)
        self.input_layernorm = DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, ctx, q_rope, kv_rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, q_rope, kv_rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        d = config.dflash_config
        self.target_layer_ids = list(d["target_layer_ids"])
        self.mask_token_id = int(d["mask_token_id"])
        self.block_size = int(d.get("block_size", getattr(config, "block_size", 16)))
        h = config.hidden_size
        self.layer_kinds = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def _theta(self) -> float:
        rope = getattr(self.config, "rope_parameters", None) or {}
        return float(rope.get("rope_theta") or getattr(self.config, "rope_theta", None) or 1_000_000.0)

    def _default_mask(self, kind: str, ctx_len: int, q_len: int, device) -> torch.Tensor:
        """One block after the whole context: context visible, block bidirectional (sliding: causal within
        the window)."""
        qi = torch.arange(q_len, device=device)[:, None]
        ctx = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device)
        blk = torch.ones(q_len, q_len, dtype=torch.bool, device=device)
        window = getattr(self.config, "sliding_window", None)
        if kind == SLIDING and window is not None:
            j = torch.arange(ctx_len, device=device)[None, :]
            ctx = ctx & (ctx_len + qi - j < window)
            ki = torch.arange(q_len, device=device)[None, :]
            blk = (ki <= qi) & (qi - ki < window)
        return torch.cat([ctx, blk], dim=1)[None, None]

    def forward(self, target_hidden, noise_embedding, position_ids, attention_mask=None, **_):
        ctx = self.hidden_norm(self.fc(target_hidden))
        s, q = target_hidden.shape[1], noise_embedding.shape[1]
        hd, theta, dtype = self.config.head_dim, self._theta(), self.fc.weight.dtype
        q_rope = _rope(position_ids[:, s:], hd, theta, dtype)
        kv_rope = _rope(position_ids, hd, theta, dtype)
        h = noise_embedding
        for layer, kind in zip(self.layers, self.layer_kinds):
            mask = attention_mask if attention_mask is not None else self._default_mask(kind, s, q, h.device)
            h = layer(h, ctx, q_rope, kv_rope, mask)
        return self.norm(h)
