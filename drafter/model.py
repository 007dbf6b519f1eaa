"""The DFlash draft model, written from the published description (docs/ARCHITECTURE.md, "Field facts").

One forward predicts a whole block: the block is the anchor token (the last accepted token) followed by
block_size-1 mask tokens, embedded with the target's frozen embedding. The target's hidden states of the
context (several layers, concatenated) are projected once by `fc` + `hidden_norm` and serve, in every
draft layer, as extra keys/values in front of the block's own keys/values. Queries come from the block
only. Inside a block attention is bidirectional (sliding-window layers: causal); a block sees the
context strictly before its anchor, which is exactly what is known at inference time (the target has
not yet run on the anchor). Block position k's output predicts the token at anchor + k.

Weight names follow z-lab's DFlashDraftModel so vLLM / SGLang / z-lab load the export unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class DraftSpec:
    """Everything that fixes the architecture; config.json is derived from it (see export.py)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        assert len(self.layer_types) == self.num_hidden_layers, "one layer type per draft layer"

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return POINTWISE.rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_tables(
    pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, L, head_dim] for positions [B, L]: rotary over the full head dim (Qwen3 default),
    computed in float32 (as HF does) or float64 for a float64 model."""
    dtype = torch.promote_types(dtype, torch.float32)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=dtype) / head_dim))
    ang = pos.to(dtype)[:, None, :, None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Halves convention (HF rotate_half): [x1, x2] -> [x1, x2] * cos + [-x2, x1] * sin. x: [B, h, L, d]."""
    d = x.shape[-1]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return (x.to(cos.dtype) * cos + rotated.to(cos.dtype) * sin).to(x.dtype)


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _Pointwise:
    """The element-wise parts of a layer (norms, rotary, MLP gate), eager by default. `compile_pointwise()` swaps
    in torch.compile'd versions with dynamic shapes: each fuses into one or two kernels, and, unlike a compiled
    layer (whose flex-attention BlockMask carries the context length as a constant), never recompiles when a
    batch's length changes. Training on CUDA does this (train.compile), with the loss's softmax (head_loss)."""

    def __init__(self):
        self.rms_norm, self.apply_rope, self.silu_gate = rms_norm, apply_rope, silu_gate


POINTWISE = _Pointwise()


def compile_pointwise() -> None:
    """Also the loss's per-chunk softmax (drafter.head_loss.compile_chunk)."""
    from dflash_pipeline.drafter.head_loss import compile_chunk

    compile_chunk(True)
    if POINTWISE.rms_norm is rms_norm:
        POINTWISE.rms_norm = torch.compile(rms_norm, dynamic=True)
        POINTWISE.apply_rope = torch.compile(apply_rope, dynamic=True)
        POINTWISE.silu_gate = torch.compile(silu_gate, dynamic=True)


def eager_pointwise() -> None:
    from dflash_pipeline.drafter.head_loss import compile_chunk

    compile_chunk(False)
    POINTWISE.__init__()


class Attention(nn.Module):
    def __init__(self, s: DraftSpec):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, q_rope: tuple, kv_rope: tuple, mask) -> torch.Tensor:
        b, q_len, _ = x.shape
        hd, nh, nkv = self.s.head_dim, self.s.num_attention_heads, self.s.num_key_value_heads
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, nh, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, nkv, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, nkv, hd).transpose(1, 2)
        q, k = POINTWISE.apply_rope(q, *q_rope), POINTWISE.apply_rope(k, *kv_rope)
        if isinstance(mask, torch.Tensor) or mask is None:
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # a flex-attention BlockMask, or one of query groups (drafter/flex.py; see train.py)
            from dflash_pipeline.drafter import flex

            if isinstance(mask, flex.QueryGroups):
                out = flex.grouped_attention(q, k, v, mask, enable_gqa=nh != nkv)
            else:
                out = flex.flex_attention(q, k, v, block_mask=mask, enable_gqa=nh != nkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, nh * hd))


class MLP(nn.Module):
    def __init__(self, s: DraftSpec):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(POINTWISE.silu_gate(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, s: DraftSpec):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, h, ctx, q_rope, kv_rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, q_rope, kv_rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """forward(context [B,S,K*H], block_embeds [B,Q,H], ctx_pos [B,S], block_pos [B,Q], masks) -> [B,Q,H]
    (after the final norm; apply the target's lm_head for logits). `masks` maps a layer type to a bool
    [B,1,Q,S+Q] tensor (True = attend) or a flex BlockMask; build them with `block_masks`."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        k, h = len(spec.target_layer_ids), spec.hidden_size
        self.fc = nn.Linear(k * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, context, block_embeds, ctx_pos, block_pos, masks: dict) -> torch.Tensor:
        ctx = self.hidden_norm(self.fc(context))
        hd, theta = self.spec.head_dim, self.spec.rope_theta
        q_rope = rope_tables(block_pos, hd, theta, self.fc.weight.dtype)
        kv_rope = rope_tables(torch.cat([ctx_pos, block_pos], dim=1), hd, theta, self.fc.weight.dtype)
        h = block_embeds
        for layer, kind in zip(self.layers, self.spec.layer_types):
            h = layer(h, ctx, q_rope, kv_rope, masks[kind])
        return self.norm(h)

    def block_masks(
        self,
        anchors: torch.Tensor,
        keep: torch.Tensor | None,
        ctx_len: int,
        flex: bool = False,
        first: torch.Tensor | None = None,
        groups: int = 1,
    ) -> dict:
        """One mask per layer type; flex=True builds FlexAttention BlockMasks (CUDA training), over `groups` query
        groups (drafter.flex.QueryGroups); `first` [B, N]: where each anchor's sample begins in a packed row
        (batching.segment_bounds; None = at 0)."""
        if flex:
            from dflash_pipeline.drafter.flex import block_sparse_mask

            make = functools.partial(block_sparse_mask, groups=groups)
        else:
            make = block_mask
        return {
            kind: make(
                anchors,
                keep,
                ctx_len,
                self.spec.block_size,
                self.spec.sliding_window if kind == SLIDING else None,
                first,
            )
            for kind in set(self.spec.layer_types)
        }


def block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor | None,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [B, 1, N*bs, ctx_len + N*bs] for N blocks per row laid out one after another.

    Context key j is visible to block n iff first[:, n] <= j < anchors[:, n] (and keep; `first` None: 0, a packed
    row: where the anchor's sample begins); block keys only within the same block. With a window (sliding layers,
    z-lab semantics): causal inside the block and query_pos - key_pos < window. A dropped block (keep False) still
    sees itself, so no row is empty.
    """
    b, n = anchors.shape
    dev = anchors.device
    off = torch.arange(block_size, device=dev)
    q_anchor = anchors[:, :, None].expand(b, n, block_size).reshape(b, -1, 1)  # [B, Q, 1]
    q_off = off.repeat(n)[None, :, None]
    q_blk = torch.arange(n, device=dev).repeat_interleave(block_size)[None, :, None]
    j = torch.arange(ctx_len, device=dev)[None, None, :]
    ctx_vis = j < q_anchor
    if first is not None:
        ctx_vis = ctx_vis & (j >= first[:, :, None].expand(b, n, block_size).reshape(b, -1, 1))
    if keep is not None:
        ctx_vis = ctx_vis & keep[:, :, None].expand(b, n, block_size).reshape(b, -1, 1)
    k_off, k_blk = q_off.transpose(1, 2), q_blk.transpose(1, 2)
    blk_vis = (q_blk == k_blk).expand(b, -1, -1)
    if window is not None:
        ctx_vis = ctx_vis & (q_anchor + q_off - j < window)
        blk_vis = blk_vis & (k_off <= q_off) & (q_off - k_off < window)
    return torch.cat([ctx_vis, blk_vis], dim=2)[:, None]
