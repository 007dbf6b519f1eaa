"""The Gated DeltaNet causal-convolution kernel: chosen by the probe, swapped in by the loader, and never
changing what a CPU forward computes (the Triton kernel itself runs on GPUs only: bench/RESULTS.md)."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction.kernels import (
    CONV_MODULES,
    conv_kernel_choice,
    fused_gdn_forward,
    gdn_forward_choice,
    gdn_layers,
    torch_gdn_kernels,
    use_conv_kernel,
    use_gdn_forward,
)
from dflash_pipeline.extraction.loader import load_target


@pytest.mark.parametrize(
    ("setting", "hybrid", "fla", "gpu", "expected"),
    [
        ("auto", True, True, True, "fla"),
        ("auto", True, True, False, "transformers"),
        ("auto", True, False, True, "transformers"),
        ("auto", False, True, True, "transformers"),
        ("transformers", True, True, True, "transformers"),
        ("fla", True, True, False, "fla"),
    ],
)
def test_the_probe_resolves_the_conv_kernel(setting, hybrid, fla, gpu, expected):
    assert conv_kernel_choice(setting, hybrid, fla, gpu) == expected


def test_asking_for_fla_without_it_names_the_package():
    with pytest.raises(CompatError, match="pip install flash-linear-attention"):
        conv_kernel_choice("fla", True, False, True)


# (model type, fla version, GPU): what 'auto' makes of it, and what an explicit 'fused' that cannot run says
GDN_CASES = [
    (("qwen3_5_text", (0, 6), True), "fused", None),
    (("qwen3_5_moe", (0, 5), True), "fused", None),
    (("qwen3_next", (0, 6), True), "transformers", "not 'qwen3_next'"),
    (("qwen3_5", None, True), "transformers", "pip install flash-linear-attention"),
    (("qwen3_5", (0, 4), True), "transformers", "0.4 predates grouped value heads: pip install -U"),
    (("qwen3_5", (0, 6), False), "transformers", "CUDA GPUs"),
]


@pytest.mark.parametrize(("case", "auto", "error"), GDN_CASES)
def test_the_probe_resolves_the_gdn_forward(case, auto, error):
    """'auto' takes the fused forward wherever it runs (the store's provenance records what ran); an explicit
    'fused' that cannot run says why and how to fix it; a dense target or 'transformers' never fuses."""
    assert gdn_forward_choice("auto", True, *case) == auto
    assert (
        gdn_forward_choice("transformers", True, *case) == gdn_forward_choice("fused", False, *case) == "transformers"
    )
    if error is None:
        assert gdn_forward_choice("fused", True, *case) == "fused"
    else:
        with pytest.raises(CompatError, match=f"extract.gdn_forward=fused: .*{error}.*set extract.gdn_forward=auto"):
            gdn_forward_choice("fused", True, *case)


def test_the_swap_is_reversible_and_leaves_a_cpu_forward_unchanged(model_dir):
    module = importlib.import_module(CONV_MODULES[0])
    model = load_target(model_dir, "dtype", "float32", "cpu")
    ids = torch.randint(5, 200, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        try:
            assert CONV_MODULES[0] in use_conv_kernel("fla")
            assert module.causal_conv1d_fn.kernel == "fla" and use_conv_kernel("fla") == []  # idempotent
            swapped = model(input_ids=ids).logits  # CPU tensors: the wrapper hands them to transformers' own
        finally:
            use_conv_kernel("transformers")
    assert getattr(module.causal_conv1d_fn, "kernel", "transformers") == "transformers"
    assert torch.equal(ref, swapped)


def test_the_fused_gdn_forward_computes_what_transformers_does(model_dir):
    """The fused forward's arrangement of a Gated DeltaNet layer (projections, convolution on [B, T, D], grouped
    value heads, gates, gated norm), run here with transformers' own PyTorch kernels: every layer's output is
    bit-equal to transformers' forward, with and without a padding mask, and so are the logits of the whole
    model once every layer runs it. (On a GPU the kernels are fla's; bench/RESULTS.md has their error against
    a float32 reference per layer.)"""
    model = load_target(model_dir, "dtype", "float32", "cpu")
    layers = gdn_layers(model)
    assert len(layers) == 6 and layers[0].num_v_heads > layers[0].num_k_heads  # grouped value heads
    kernels = torch_gdn_kernels()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, model.config.hidden_size, generator=gen)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, 30:] = 0
    with torch.no_grad():
        for layer in layers:
            for m in (None, mask):
                assert torch.equal(fused_gdn_forward(layer, kernels, x, m), layer(x, attention_mask=m))

        ids = torch.randint(5, 200, (2, 37), generator=gen)
        ref = model(input_ids=ids).logits
        calls = []
        counting = kernels._replace(conv=lambda *a: calls.append(1) or kernels.conv(*a))
        try:
            assert use_gdn_forward(model, "fused", counting) == len(layers)
            fused = model(input_ids=ids).logits
        finally:
            assert use_gdn_forward(model, "transformers") == 0
        assert len(calls) == len(layers) and torch.equal(fused, ref)
        assert not any("forward" in vars(m) for m in layers)  # back to the class's forward

        # a forward someone else put on the instance (accelerate's device hooks do) is kept and restored
        hooked = layers[0].forward = functools.partial(type(layers[0]).forward, layers[0])
        use_gdn_forward(model, "fused", kernels)
        assert layers[0].forward is not hooked
        use_gdn_forward(model, "transformers")
        assert layers[0].forward is hooked
        assert torch.equal(model(input_ids=ids).logits, ref)
