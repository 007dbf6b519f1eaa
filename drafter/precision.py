"""How the drafter's training computes (train.precision): float32, float32 weights under autocast, or a bfloat16
copy of float32 master weights.

Under autocast every forward casts each float32 weight to bfloat16, and every norm (float32 weight times a
bfloat16 activation) returns float32, which the next linear casts back: on an H200 those copies were ~11% of a
step's GPU time, with the residual stream's norms, rotary and attention inputs in float32. With `bf16` the
forward and backward run on a bfloat16 copy of the model; the optimizer, gradient clipping, checkpoints and the
export keep the float32 masters. After the backward each copy gradient is folded into its master in float32
(`fold_grads`), and after the optimizer step the copy is refreshed from the masters (`refresh`): one cast of the
weights per optimizer step. The copy's weights are the masters rounded to bfloat16, exactly what autocast would
compute with, so the two differ only in where activations are rounded (tests/unit/test_train_precision.py).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from dflash_pipeline.errors import ConfigError


def resolve(precision: str, device: torch.device) -> str:
    """'auto' -> 'bf16' on CUDA, 'fp32' on CPU; anything else as asked (bf16 and autocast run on CPU too)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision not in ("fp32", "autocast", "bf16"):
        raise ConfigError(f"train.precision={precision!r}: use 'auto', 'fp32', 'autocast' or 'bf16'")
    return precision


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the activations the drafter sees (target states, block embeddings, the frozen head)."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def autocast(precision: str, device: torch.device):
    if precision == "autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class ComputeCopy:
    """The module forward and backward run on: the master itself (fp32, autocast), or its bfloat16 copy (bf16)."""

    def __init__(self, master: nn.Module, precision: str):
        self.master, self.precision = master, precision
        self.module = copy.deepcopy(master).to(torch.bfloat16) if precision == "bf16" else master
        self._pairs = list(zip(master.parameters(), self.module.parameters())) if precision == "bf16" else []

    def fold_grads(self) -> None:
        """Each copy gradient (the sum over the step's micro-batches, in bfloat16) into its master, as float32."""
        for m, c in self._pairs:
            m.grad = None if c.grad is None else c.grad.to(m.dtype)
            c.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy from the masters (after an optimizer step or a checkpoint load)."""
        for m, c in self._pairs:
            c.copy_(m)
