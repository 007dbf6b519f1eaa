"""Capture the outputs of chosen decoder layers with forward hooks, stopping after the last needed one.

This is the one definition of "the value of layer id i" (the output of decoder layer i, before any final
norm): extraction stores it, and the drafter's evaluation reads the target's features through it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dflash_pipeline.extraction.loader import base_model, decoder_layers
from dflash_pipeline.storage.commit import crash_point


class _Stop(Exception):
    """Raised by the hook on the highest needed layer: the rest of the forward is skipped."""


class LayerCapture:
    """`capture.packed(input_ids, attention_mask, rows)` -> (hidden [N, K, H], last [N, H] or None).

    hidden[:, j, :] is the output of decoder layer layer_ids[j] (= HF hidden_states[id + 1], except for
    the last layer, whose HF entry is after the final norm); `last` is the last decoder layer's output
    before the final norm.
    """

    def __init__(self, model, layer_ids: list[int], capture_last: bool = False):
        self.model = model
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        n = len(self.layers)
        self.last_id = n - 1 if capture_last else None
        self.needed = sorted(set(self.layer_ids) | ({n - 1} if capture_last else set()))
        self.stop_after = self.needed[-1]

    @contextmanager
    def recording(self, stop: bool) -> Iterator[dict[int, torch.Tensor]]:
        """Hooks on the needed layers while the block runs; yields {layer id: output [B, T, H]}. With
        `stop`, the forward ends (raises _Stop) after the highest needed layer."""
        outs: dict[int, torch.Tensor] = {}

        def hook(idx):
            def fn(_module, _args, output):
                outs[idx] = output[0] if isinstance(output, tuple) else output
                if stop and idx == self.stop_after:
                    raise _Stop

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.needed]
        try:
            yield outs
        finally:
            for h in handles:
                h.remove()

    def features(self, outs: dict[int, torch.Tensor]) -> torch.Tensor:
        """The captured layers concatenated along the hidden axis: [B, T, K*H] (the drafter's input)."""
        return torch.cat([outs[i] for i in self.layer_ids], dim=-1)

    @torch.inference_mode()
    def packed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor):
        """(hidden [N, K, H], last [N, H] or None) for the flat positions `rows` (indices into B*T, on the
        model's device), in that order. Gathering by a known index keeps the forward asynchronous: a
        boolean mask would make the host wait for the GPU to learn the output's size."""

        def pick(t: torch.Tensor) -> torch.Tensor:  # (on a split replica, layers live on several GPUs)
            return t.reshape(-1, t.shape[-1]).to(rows.device).index_select(0, rows)

        with self.recording(stop=True) as outs:
            try:
                crash_point("forward")
                base_model(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _Stop:
                pass
        hidden = torch.stack([pick(outs[i]) for i in self.layer_ids], dim=1)
        last = pick(outs[self.last_id]) if self.last_id is not None else None
        return hidden, last
