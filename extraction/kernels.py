"""Faster kernels for the parts of a hybrid target that transformers runs in PyTorch.

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
