"""Acceptance measured by a decoder we did not write: z-lab's reference DFlash code (PyPI `dflash` 0.1.0, its
`dflash/model.py`), loading our export as it ships (config.json + model.safetensors, drafter/export.py).

`evaluate.decoder` (drafter/config.py): `ours` (drafter/evaluate.py's speculative_generate), `reference` (this
module), or `both` (each on the same prompts: the report holds both figures and their ratio).

What runs is the reference package's own decoding: `DFlashDraftModel.from_pretrained(export)` and
`dflash_generate`, the function its `spec_generate` is (greedy, temperature 0, the export's block size), called
with `return_stats=True` for the tokens produced per verification step (`acceptance_lengths`, the same per-step
count as ours: accepted drafts + the target's bonus token, cut at max_new_tokens and at a stop token). It keeps KV
caches for the target and the drafter where ours recomputes everything each step, and it shortens the last block
to what max_new_tokens leaves (ours drafts a whole block and keeps what fits), so the two can differ in the last
step of a prompt and by float rounding; tests/integration/test_reference_decoder.py measures the agreement.

The package pins datasets, tqdm and requests to versions this project does not use; its model needs only torch
and transformers, so it is installed without its dependencies (PIP below).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash_pipeline.errors import ConfigError

PIP = "pip install --no-deps dflash==0.1.0"
VERSION = "0.1.0"  # the version whose decoding was checked against ours


def require_dflash():
    """z-lab's `dflash.model`, or ConfigError naming the install command."""
    try:
        import dflash.model as reference
    except ImportError as e:
        raise ConfigError(
            f"evaluate.decoder asks for z-lab's reference decoder, but the `dflash` package cannot be imported ({e}): "
            f"install it with `{PIP}` (without its pinned dependencies: its decoder needs only torch and "
            "transformers), or set evaluate.decoder=ours"
        ) from e
    return reference


def dflash_version() -> str | None:
    try:
        return importlib.metadata.version("dflash")
    except importlib.metadata.PackageNotFoundError:
        return None


def key(decoder: str) -> dict:
    """What a result of the reference decoder also depends on (evaluate.py adds it to the evaluation key): the
    setting, the package's version and this module's source (its adapters). Checks the package is importable."""
    require_dflash()
    import hashlib

    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return {"decoder": decoder, "dflash": dflash_version(), "adapter": code}


def load_reference(export_dir: str | Path, device: str | torch.device, dtype: torch.dtype):
    """The export loaded by the reference model class, as a user of z-lab's code would load it."""
    reference = require_dflash()
    model = reference.DFlashDraftModel.from_pretrained(str(export_dir), dtype=dtype)
    return model.to(device).eval()


@contextlib.contextmanager
def _adapted(reference, device: torch.device, block_size: int) -> Iterator[None]:
    """Two adapters of the reference code to this environment while it runs, neither of which touches its decoding:
    - its caches: `_make_cache` calls `activate_past_recording()` so that `crop` can roll the target's cache back
      after a partly accepted block. transformers (5.2x) rolls a linear-attention (Gated DeltaNet) layer back only
      to a recurrent state it kept, and keeps as many as `recurrent_states_to_keep` says; without it (None) a hybrid
      target's forward fails (`min(None, seq_len)`). The cache here keeps block_size of them: a verification
      forward covers at most one block, so every rollback `crop` asks for is within them. (The package was made
      against transformers 5.15; for an attention-only target nothing changes.)
    - its clock: dflash_generate(return_stats=True) times itself with torch.cuda.synchronize(), which fails without
      CUDA; on another device it is time.perf_counter."""
    make, clock = reference._make_cache, reference._cuda_time

    def make_cache(config):
        cache = reference.DynamicCache(config=config)
        cache.activate_past_recording(recurrent_states_to_keep=block_size)
        return cache

    reference._make_cache = make_cache
    if device.type != "cuda":
        reference._cuda_time = time.perf_counter
    try:
        yield
    finally:
        reference._make_cache, reference._cuda_time = make, clock


@torch.inference_mode()
def reference_generate(
    target, model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding by the reference code: (generated tokens, tokens produced per verification step),
    the pair drafter/evaluate.py's speculative_generate returns."""
    reference = require_dflash()
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=dev)
    with _adapted(reference, dev, int(model.block_size)):
        stats = reference.dflash_generate(
            model, target, ids, max_new_tokens, sorted(stop_ids), temperature=0.0, return_stats=True
        )
    return stats.output_ids[0, len(prompt_ids) :].tolist(), [int(x) for x in stats.acceptance_lengths]
