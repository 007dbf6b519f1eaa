"""A store version's identity and name: the attributes two runs must share to write one version, and the refusals."""

from __future__ import annotations

import re
from typing import Any

# Attributes that must match for two runs to share one store version.
IDENTITY_KEYS = (
    "model_config_hash",
    "weights_fingerprint",
    "layer_ids",
    "capture_last",
    "logical_dtype",
    "precision",
    "int8_scales",
    "hidden_size",
    "format_version",
    "target_quantization",
)
VERSION_NAME = re.compile(r"v[0-9]+")  # v0001, v0002, ... (Store.new_version_name)
# Identity attributes that versions written before they existed lack, and the value those versions have.
IDENTITY_DEFAULTS = {"precision": "full", "target_quantization": None}  # None: an unquantized target


def identity_value(attrs: dict[str, Any], key: str) -> Any:
    """The identity attribute `key` of a version's `attrs` (or a run's provenance), its default where absent."""
    return attrs.get(key, IDENTITY_DEFAULTS.get(key))


def _difference(key: str, a: Any, b: Any) -> str:
    """One identity key that differs, briefly: of two dicts (a quantized target's record) only the entries that
    differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        sub = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        return "; ".join(f"{key}.{k}: store has {a.get(k)!r}, this run has {b.get(k)!r}" for k in sub)
    return f"{key}: store has {a!r}, this run has {b!r}"


def same_identity(attrs: dict[str, Any], provenance: dict[str, Any]) -> bool:
    """Whether a version with root attributes `attrs` holds states of the run with this `provenance`."""
    return all(identity_value(attrs, k) == identity_value(provenance, k) for k in IDENTITY_KEYS)


def other_target(store_url: str, attrs: dict[str, Any], provenance: dict[str, Any]) -> str:
    """Why a run is refused a store whose newest version (root attributes `attrs`) has another identity."""
    diffs = {
        k: (identity_value(attrs, k), identity_value(provenance, k))
        for k in IDENTITY_KEYS
        if identity_value(attrs, k) != identity_value(provenance, k)
    }
    shown = "; ".join(_difference(k, a, b) for k, (a, b) in diffs.items())
    return (
        f"store {store_url} holds states of another target, layer set or forward ({shown}). "
        "Refusing to mix them. Set extract.new_version=true to start a new store "
        "version beside it, or use another store_path"
    )


def other_dataset(version_url: str, fingerprints: list[str], dataset_fp: str) -> str:
    """Why a run that is not incremental is refused a version made from other prepared datasets."""
    return (
        f"store {version_url} was made from prepared dataset(s) {fingerprints}, this run's is {dataset_fp}: its "
        "rows differ, or a setting that makes them (data.source, data.max_samples or another data.* setting, the "
        "tokenizer or chat template, regenerate). Set extract.incremental=true to add the rows the store lacks (the "
        "samples it holds are kept, not extracted again), or use another store_path"
    )
