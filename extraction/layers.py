"""Which decoder layers to capture (convention: id i = output of decoder layer i = hidden_states[i+1])."""

from __future__ import annotations

from dflash_pipeline.config import LayersConfig
from dflash_pipeline.errors import ConfigError


def dflash_layer_ids(num_layers: int, n: int) -> list[int]:
    """z-lab / SpecForge default: spread n layers from layer 1 to layer L-3."""
    if n == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]


def eagle3_layer_ids(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def select_layer_ids(cfg: LayersConfig, num_layers: int) -> list[int]:
    if cfg.preset == "dflash":
        if num_layers < 5 and cfg.num_draft_layers > 1:
            raise ConfigError(
                f"layers.preset=dflash needs a target with >= 5 layers (this one has "
                f"{num_layers}); use layers.preset=explicit with layers.ids"
            )
        ids = dflash_layer_ids(num_layers, cfg.num_draft_layers)
    elif cfg.preset == "eagle3":
        ids = eagle3_layer_ids(num_layers)
    else:
        ids = list(cfg.ids or [])
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"layer id(s) {bad} out of range: this target has {num_layers} decoder layers, "
            f"valid ids are 0..{num_layers - 1} (id i = output of decoder layer i)"
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"layer ids {ids} contain duplicates (from preset {cfg.preset!r})")
    return ids
