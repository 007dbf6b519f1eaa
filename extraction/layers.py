"""Which decoder layers to capture (convention: id i = output of decoder layer i = hidden_states[i+1]).

Small targets: the dflash preset spreads its layers over layers 1..L-3, which hold L-3 distinct layers. With the
default layers.num_draft_layers and a target too small for it (a 6-layer model has 3), the preset captures as
many layers as there are and says so in the log (the drafter then has as many layers, unless
train.num_draft_layers says otherwise). A count the user set is never changed: it is an error naming the count
that fits and the explicit alternative. The eagle3 preset's three layers have no smaller form: too small a target
is an error naming the settings to use instead.
"""

from __future__ import annotations

import logging

from dflash_pipeline.errors import ConfigError
from dflash_pipeline.extraction.config import LayersConfig

log = logging.getLogger(__name__)
EAGLE3_MIN_LAYERS = 7  # [1, L//2 - 1, L - 4] are distinct from 7 layers on


def dflash_layer_ids(num_layers: int, n: int) -> list[int]:
    """z-lab / SpecForge default: spread n layers from layer 1 to layer L-3."""
    if n == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]


def dflash_max_layers(num_layers: int) -> int:
    """How many distinct layers the dflash spread (layers 1..L-3) has: the most it can capture."""
    return max(1, num_layers - 3)


def eagle3_layer_ids(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def _spread(num_layers: int, n: int) -> list[int]:
    """n distinct ids spread over 0..L-1 (n <= L): an example for layers.ids."""
    n = min(n, num_layers)
    return [round(i * (num_layers - 1) / (n - 1)) for i in range(n)] if n > 1 else [num_layers // 2]


def _shell(ids: list[int]) -> str:
    """A list as a --set value without spaces (no quoting needed in a shell)."""
    return "[" + ",".join(map(str, ids)) + "]"


def _dflash_ids(cfg: LayersConfig, num_layers: int, announce: bool) -> list[int]:
    n, fit = cfg.num_draft_layers, dflash_max_layers(num_layers)
    if n <= fit:
        return dflash_layer_ids(num_layers, n)
    if "num_draft_layers" in cfg.model_fields_set:  # the user's count: never changed behind their back
        raise ConfigError(
            f"layers.num_draft_layers={n} is more than this target's {num_layers} decoder layers give: the dflash "
            f"preset spreads its layers over layers 1..{max(1, num_layers - 3)} ({fit} distinct). Set "
            f"layers.num_draft_layers={fit}, or name the layers: layers.preset=explicit "
            f"layers.ids={_shell(_spread(num_layers, n))}"
        )
    ids = dflash_layer_ids(num_layers, fit)
    if announce:
        log.warning(
            "this target has %d decoder layers: the dflash preset captures %d layers %s, not the default %d "
            "(set layers.num_draft_layers, or layers.preset=explicit with layers.ids, to choose)",
            num_layers,
            fit,
            ids,
            n,
        )
    return ids


def select_layer_ids(cfg: LayersConfig, num_layers: int, announce: bool = True) -> list[int]:
    """The layer ids to capture; `announce`: log a preset that adapted to a small target (the probe does; the
    CLI's pre-flight check, which runs before it, does not)."""
    if cfg.preset == "dflash":
        ids = _dflash_ids(cfg, num_layers, announce)
    elif cfg.preset == "eagle3":
        if num_layers < EAGLE3_MIN_LAYERS:
            raise ConfigError(
                f"layers.preset=eagle3 needs a target with at least {EAGLE3_MIN_LAYERS} decoder layers (it takes "
                f"layers 1, L/2-1 and L-4; this one has {num_layers}): use layers.preset=dflash (it adapts to small "
                f"targets), or layers.preset=explicit layers.ids={_shell(_spread(num_layers, 3))}"
            )
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
        once = list(dict.fromkeys(ids))
        raise ConfigError(
            f"layers.ids {ids} name a layer more than once: give each once, e.g. layers.ids={_shell(once)}"
        )
    return ids
