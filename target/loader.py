"""Load the target for inference through the probed dtype keyword."""

from __future__ import annotations

import logging

import torch

from pipeline.errors import CompatError

log = logging.getLogger(__name__)


def load_target(model_path: str, dtype_kwarg: str, dtype: str, device: str, attn_implementation: str | None = None,
                trust_remote_code: bool = False):
    """An eval-mode causal LM on `device`, gradients off. Missing or corrupt files raise CompatError."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    kwargs = {dtype_kwarg: getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:
        raise CompatError(f"cannot load the target from {model_path}: {type(e).__name__}: {e}. "
                          "Check that the directory holds a complete checkpoint (config.json and all weight "
                          "files) and re-download it if a file is truncated") from e
    model.to(device).eval()
    model.requires_grad_(False)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if layers is None:
        raise CompatError(f"{type(model).__name__} has no model.layers: hidden-state capture supports "
                          "decoder-only models with a `layers` ModuleList")
    return layers


def base_model(model):
    """The decoder stack without lm_head (calling it skips the vocabulary projection)."""
    base = getattr(model, "model", None)
    return base if base is not None else model.get_decoder()
