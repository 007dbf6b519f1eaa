"""Capture the outputs of chosen decoder layers with forward hooks, stopping after the last needed one."""

from __future__ import annotations

import torch

from storage.commit import crash_point
from target.loader import base_model, decoder_layers


class _Stop(Exception):
    """Raised by the hook on the highest needed layer: the rest of the forward is skipped."""


class LayerCapture:
    """`capture(input_ids, attention_mask)` -> (hidden [B, T, K, H], last [B, T, H] or None).

    hidden[..., j, :] is the output of decoder layer layer_ids[j] (= HF hidden_states[id + 1]); `last` is
    the last decoder layer's output before the final norm (HF's hidden_states[-1] is after it).
    `capture.packed(input_ids, attention_mask, rows)` gives the same values for the real tokens only.
    """

    def __init__(self, model, layer_ids: list[int], capture_last: bool = False):
        self.model = model
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        n = len(self.layers)
        self.last_id = n - 1 if capture_last else None
        self.needed = sorted(set(self.layer_ids) | ({n - 1} if capture_last else set()))
        self.stop_after = self.needed[-1]

    def _outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[int, torch.Tensor]:
        outs: dict[int, torch.Tensor] = {}

        def hook(idx):
            def fn(_module, _args, output):
                outs[idx] = output[0] if isinstance(output, tuple) else output
                if idx == self.stop_after:
                    raise _Stop

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.needed]
        try:
            crash_point("forward")
            base_model(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
        return outs

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        outs = self._outputs(input_ids, attention_mask)
        hidden = torch.stack([outs[i] for i in self.layer_ids], dim=2)
        last = outs[self.last_id] if self.last_id is not None else None
        return hidden, last

    @torch.inference_mode()
    def packed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor):
        """(hidden [N, K, H], last [N, H] or None) for the flat positions `rows` (indices into B*T, on the
        model's device), in that order. Gathering by a known index keeps the forward asynchronous: a
        boolean mask would make the host wait for the GPU to learn the output's size."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, t.shape[-1]).index_select(0, rows)

        outs = self._outputs(input_ids, attention_mask)
        hidden = torch.stack([pick(outs[i]) for i in self.layer_ids], dim=1)
        last = pick(outs[self.last_id]) if self.last_id is not None else None
        return hidden, last
