"""Faster kernels for the parts of a hybrid target that transformers runs in PyTorch: the causal convolution of
its Gated DeltaNet layers (extract.conv_kernel), and those layers' whole forward (extract.gdn_forward, below).

transformers' Gated DeltaNet layers (qwen3_5, qwen3_next) call a module-level `causal_conv1d_fn` on a
[B, D, T] tensor; without the causal-conv1d CUDA package (which needs compiling) that is an F.conv1d fallback.
flash-linear-attention (fla-core) ships a Triton causal convolution on [B, T, D]. Measured on one H200
(docs/ARCHITECTURE.md, bench/RESULTS.md): 0.33 vs 2.12 ms per call at B=8, D=10240, T=2048, closer to an fp32
reference (rel. L2 1.7e-3 vs 2.6e-3), and a 62-layer 27B-shape forward from 9,337 to 10,253 tokens/s.

The swap rebinds the module-level function, so it applies to every model of that class in the process: an
extraction worker (one per GPU) and the validation that recomputes with the same forward both run it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# transformers modules whose Gated DeltaNet calls a module-level causal_conv1d_fn([B, D, T], weight [D, W], ...).
CONV_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_next.modeling_qwen3_next")
_ORIGINAL = "_dflash_original_causal_conv1d_fn"


def conv_kernel_choice(setting: str, hybrid: bool, fla: bool, gpu: bool) -> str:
    """extract.conv_kernel resolved: 'fla' (Triton), or 'transformers' (its own choice: the causal-conv1d
    package when installed, else PyTorch)."""
    if setting == "transformers" or not hybrid:
        return "transformers"
    if setting == "fla" and not fla:
        from dflash_pipeline.errors import CompatError

        raise CompatError(
            "extract.conv_kernel=fla needs flash-linear-attention: pip install flash-linear-attention "
            "(or set extract.conv_kernel=auto)"
        )
    return "fla" if fla and (gpu or setting == "fla") else "transformers"


def _fla_conv(original):
    """transformers' causal_conv1d_fn contract ([B, D, T] in and out) on fla's Triton kernel ([B, T, D]);
    `original` for what the kernel is not used for here (CPU tensors, packed sequences)."""

    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        if hidden_states.device.type != "cuda" or any(kwargs.get(k) is not None for k in ("seq_idx", "cu_seqlens")):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from fla.modules.causal_conv1d import causal_conv1d

        # [B, D, T] here is a transposed view of a contiguous [B, T, D]: both transposes are free.
        y, _ = causal_conv1d(hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        return y.transpose(1, 2)

    conv.kernel = "fla"
    return conv


def use_conv_kernel(kernel: str) -> list[str]:
    """Make the Gated DeltaNet modules call `kernel`'s causal convolution ('fla' or 'transformers');
    returns the modules changed."""
    changed = []
    for name in CONV_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "causal_conv1d_fn", None)
        if current is None:
            continue
        original = getattr(module, _ORIGINAL, current)
        setattr(module, _ORIGINAL, original)
        if getattr(current, "kernel", "transformers") != kernel:
            module.causal_conv1d_fn = _fla_conv(original) if kernel == "fla" else original
            changed.append(name)
    if changed:
        log.info("causal convolution of the Gated DeltaNet layers: %s (%s)", kernel, ", ".join(changed))
    return changed


# ---- the Gated DeltaNet forward -------------------------------------------------------------------------------
#
# transformers' forward of a Qwen3.5/3.6 Gated DeltaNet layer reaches flash-linear-attention for the chunked delta
# rule only; around it, a [B, T, D] <-> [B, D, T] round trip for the convolution, query/key heads repeated up to the
# value heads (older versions), and the gated RMSNorm as ~10 PyTorch kernels in float32 over every value channel.
# `fused` is the same computation in the order transformers does it, on fla's kernels: the Triton convolution
# straight on the projection's [B, T, D] output, the delta rule with grouped value heads (fla >= 0.5) and
# l2-normalised q/k in the kernel, and fla's fused gated RMSNorm (one kernel). bench/RESULTS.md has its speed and
# its error against a float32 reference per layer; tests/integration/test_kernels.py checks, on CPU with PyTorch
# kernels, that it computes what transformers' forward does.

GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log", "norm", "out_proj")
# Keyword arguments under which the fused forward does not apply (a cache, packed sequences): transformers' runs.
_NOT_FUSED = ("cache", "cache_params", "past_key_values", "cu_seq_lens_q", "cu_seqlens", "seq_idx")


class GdnKernels(NamedTuple):
    conv: Callable  # (x [B, T, D], weight [D, W], bias, activation) -> [B, T, D]
    delta_rule: Callable  # (q [B, T, H, K], k, v [B, T, HV, V], g [B, T, HV] log decay, beta) -> [B, T, HV, V]
    gated_norm: Callable  # (o [N, V], z [N, V], the layer's norm module) -> norm(o) * silu(z), [N, V]
    devices: tuple[str, ...]  # device types the kernels run on


# Model types (prefixes) whose Gated DeltaNet layers have the projections the fused forward reads (GDN_PARTS):
# qwen3_5, qwen3_5_text, qwen3_5_moe, ... Qwen3-Next packs them differently (in_proj_qkvz, in_proj_ba).
FUSED_MODEL_TYPES = ("qwen3_5",)
FLA_GROUPED_HEADS = (0, 5)  # fla takes fewer query/key heads than value heads from this version on


def fla_version() -> tuple[int, ...] | None:
    try:
        import fla

        return tuple(int(x) for x in fla.__version__.split(".")[:2])
    except (ImportError, AttributeError, ValueError):
        return None


def gdn_forward_choice(setting: str, hybrid: bool, model_type: str, fla: tuple[int, ...] | None, gpu: bool) -> str:
    """extract.gdn_forward resolved: 'fused' (ours, on fla's kernels: `fla` is its version, None when it is not
    installed) or 'transformers' (the class's forward). 'auto' takes 'fused' wherever it runs; an explicit
    'fused' that cannot run is an error naming why."""
    if setting == "transformers" or not hybrid:
        return "transformers"
    if not model_type.startswith(FUSED_MODEL_TYPES):
        why = f"it covers Qwen3.5/3.6 Gated DeltaNet layers (model types {FUSED_MODEL_TYPES[0]}*), not {model_type!r}"
    elif fla is None:
        why = "it needs flash-linear-attention: pip install flash-linear-attention"
    elif fla < FLA_GROUPED_HEADS:
        version = ".".join(map(str, fla))
        why = f"flash-linear-attention {version} predates grouped value heads: pip install -U flash-linear-attention"
    elif not gpu:
        why = "fla's Triton kernels run on CUDA GPUs, and extract.devices names none"
    else:
        return "fused"
    if setting == "fused":
        from dflash_pipeline.errors import CompatError

        raise CompatError(f"extract.gdn_forward=fused: {why} (or set extract.gdn_forward=auto)")
    return "transformers"


def fla_gdn_kernels() -> GdnKernels:
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def conv(x, weight, bias, activation):
        return causal_conv1d(x, weight=weight, bias=bias, activation=activation)[0]  # strided x: read in place

    def delta_rule(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    def gated_norm(o, z, norm):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        return rms_norm_gated(o, z, norm.weight, None, activation=getattr(norm, "activation", "silu"), eps=eps)

    return GdnKernels(conv, delta_rule, gated_norm, ("cuda",))


def torch_gdn_kernels(module_name: str = CONV_MODULES[0]) -> GdnKernels:
    """transformers' own PyTorch kernels behind the GdnKernels contract: the fused forward's arrangement of the
    layer, checkable on a CPU against transformers' forward."""
    module = importlib.import_module(module_name)
    conv_fn = getattr(module, _ORIGINAL, module.causal_conv1d_fn)

    def conv(x, weight, bias, activation):
        return conv_fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)

    def delta_rule(q, k, v, g, beta):
        if k.shape[2] != v.shape[2]:  # older fallbacks want as many query/key heads as value heads
            q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
        return module.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    return GdnKernels(conv, delta_rule, lambda o, z, norm: norm(o, z), ("cpu", "cuda"))


def fused_gdn_forward(layer, kernels: GdnKernels, hidden_states: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """One Gated DeltaNet layer without a cache, as transformers' forward computes it (same order of operations)."""
    if attention_mask is not None:  # a 2D padding mask zeroes the padded positions' inputs, as transformers does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq, _ = hidden_states.shape
    conv = layer.conv1d
    qkv = kernels.conv(layer.in_proj_qkv(hidden_states), conv.weight.squeeze(1), conv.bias, layer.activation)
    q, k, v = torch.split(qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(batch, seq, -1, layer.head_k_dim)
    k = k.reshape(batch, seq, -1, layer.head_k_dim)
    v = v.reshape(batch, seq, -1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden_states).sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden_states).float() + layer.dt_bias)
    o = kernels.delta_rule(q, k, v, g, beta)
    z = layer.in_proj_z(hidden_states)
    o = kernels.gated_norm(o.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim), layer.norm)
    return layer.out_proj(o.reshape(batch, seq, -1))


def gdn_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet") and _has_parts(m)]


def _has_parts(m) -> bool:
    return all(hasattr(m, p) for p in GDN_PARTS) and hasattr(m, "key_dim") and hasattr(m, "head_v_dim")


def use_gdn_forward(model, choice: str, kernels: GdnKernels | None = None) -> int:
    """Give every Gated DeltaNet layer of `model` the forward `choice` ('fused' or 'transformers'); returns how
    many layers run the fused forward. A call the fused forward does not cover (a cache, packed sequences, a
    device the kernels do not run on, a layer on another device than its input) goes to transformers' forward.
    `kernels`: fla's by default (tests pass transformers' PyTorch ones)."""
    assert choice in ("fused", "transformers"), choice
    layers = gdn_layers(model)
    if choice == "transformers":
        kernels = None
    elif kernels is None and layers:
        kernels = fla_gdn_kernels()
    for m in layers:
        if "_dflash_gdn_original" in vars(m):  # undo an earlier choice first, keeping a hook accelerate put there
            original = m._dflash_gdn_original
            del m._dflash_gdn_original
            if original is None:
                del m.forward
            else:
                m.forward = original
        if kernels is not None:
            m._dflash_gdn_original = vars(m).get("forward")  # None: the class's forward
            m.forward = _fused_or_original(m, m.forward, kernels)
    if layers and choice == "fused":
        log.info("Gated DeltaNet forward: fused on flash-linear-attention kernels (%d layers)", len(layers))
    return len(layers) if choice == "fused" else 0


def _fused_or_original(layer, original, kernels: GdnKernels):
    def forward(hidden_states, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        if (
            args
            or hidden_states.device.type not in kernels.devices
            or hidden_states.device != layer.conv1d.weight.device
            or any(kwargs.get(k) is not None for k in _NOT_FUSED)
            or (mask is not None and mask.dim() != 2)
        ):
            return original(hidden_states, *args, **kwargs)
        return fused_gdn_forward(layer, kernels, hidden_states, mask)

    return forward
