"""The Gated DeltaNet causal-convolution kernel: chosen by the probe, swapped in by the loader, and never
changing what a CPU forward computes (the Triton kernel itself runs on GPUs only: bench/RESULTS.md)."""

from __future__ import annotations

import importlib

import pytest
import torch

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction.kernels import CONV_MODULES, conv_kernel_choice, use_conv_kernel
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
