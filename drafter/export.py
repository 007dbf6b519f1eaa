"""Servable checkpoint: an HF-style directory that z-lab's DFlash code, vLLM and SGLang load.

Format (documented here because the test re-implements a forward from it):
- config.json: a Qwen3 config (`model_type: qwen3`) with `architectures: ["DFlashDraftModel"]`;
  `num_hidden_layers` = draft layers; `num_target_layers`; `block_size`; `dflash_config:
  {target_layer_ids, mask_token_id, block_size}`; `layer_types` + `sliding_window` when some layers use
  a window (those layers are causal inside the block, others bidirectional). Head dims, eps, rope_theta
  (`rope_parameters`, rotary over the full head_dim) and vocab come from the target.
- model.safetensors: `fc.weight` [H, K*H], `hidden_norm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
  `layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
  `layers.{i}.{input,post_attention}_layernorm.weight`, `norm.weight`. No embedding / lm_head: the
  target's are used. RMSNorms are Qwen3's (x / rms * weight).
- modeling_dflash.py: a self-contained `DFlashDraftModel` (torch + transformers only); config.json's
  `auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}` points AutoModel at it, so
  `AutoModel.from_pretrained(export, trust_remote_code=True)` gives the drafter (as z-lab documents).
- dflash_meta.json (ours, ignored by servers): training / evaluation provenance. Training writes
  `train_config`, `store`, `store_version`, `target`, `steps`, `final_loss`; evaluation adds `acceptance`
  (drafter/evaluate.py `AcceptanceReport.to_dict()`): `acceptance_length`, `block_size`, `num_prompts`,
  `verify_steps`, `generated_tokens`, `position_accept_rate` [block_size-1], `untrained_acceptance_length`,
  `untrained_position_accept_rate`, `slices` ({field of evaluate.slice_by: [{value, num_prompts, verify_steps,
  generated_tokens, acceptance_length, position_accept_rate, untrained_acceptance_length}]}), `per_prompt` and
  `untrained_per_prompt` ([{id, tokens, steps, acceptance_length, produced: tokens per verification step,
  slices: {field: value}}]), `plot_path` (acceptance.png beside the export), `reused` / `baseline_reused`
  (whether the figures were measured by that evaluation), `target_forwards` / `baseline_forwards`,
  `baseline_cache`, `key` + `key_digest` (what the figures depend on: an evaluation with the same key reuses
  them), `baseline_key_digest`, `elapsed_s`.

The directory and its files get the permissions the process's umask allows (0755 / 0644 under the usual
022), not the 0700 of a temp directory: a serving container or another user must be able to read them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.drafter.model import FULL, DFlashDrafter, DraftSpec
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.fsmodes import as_made

CONFIG, WEIGHTS, META = "config.json", "model.safetensors", "dflash_meta.json"
MODELING = "modeling_dflash.py"
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def _make_readable(directory: Path) -> None:
    """Give the directory and its files the modes a plain mkdir / open would (0o777 / 0o666 less the umask)."""
    for p in (directory, *directory.iterdir()):
        as_made(p)


def hf_config(spec: DraftSpec, dtype: str = "bfloat16") -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": dict(AUTO_MAP),
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "dflash_config": {
            "target_layer_ids": list(spec.target_layer_ids),
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
        },
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": False,
        "dtype": dtype,
    }
    if any(t != FULL for t in spec.layer_types):
        cfg.update(
            layer_types=list(spec.layer_types),
            sliding_window=spec.sliding_window,
            use_sliding_window=True,
            max_window_layers=spec.num_hidden_layers,
        )
    return cfg


def spec_from_hf_config(cfg: dict[str, Any]) -> DraftSpec:
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ConfigError(f"config.json architectures={cfg.get('architectures')} is not a DFlash drafter")
    d = cfg.get("dflash_config") or {}
    rope = cfg.get("rope_parameters") or {}
    n = int(cfg["num_hidden_layers"])
    return DraftSpec(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        num_hidden_layers=n,
        vocab_size=cfg["vocab_size"],
        target_layer_ids=list(d["target_layer_ids"]),
        num_target_layers=cfg["num_target_layers"],
        block_size=int(d.get("block_size", cfg.get("block_size", 16))),
        mask_token_id=int(d["mask_token_id"]),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        sliding_window=cfg.get("sliding_window"),
        layer_types=list(cfg.get("layer_types") or [FULL] * n),
    )


def export_drafter(
    model: DFlashDrafter, out_dir: str | Path, meta: dict | None = None, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the directory atomically (temp dir + rename); an existing export is replaced."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        dt = str(dtype).removeprefix("torch.")
        (tmp / CONFIG).write_text(json.dumps(hf_config(model.spec, dt), indent=2))
        (tmp / META).write_text(json.dumps(meta or {}, indent=2, default=str))
        shutil.copyfile(Path(__file__).with_name(MODELING), tmp / MODELING)
        _make_readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / CONFIG).exists() or not (p / WEIGHTS).exists():
        raise ConfigError(f"{p} is not a drafter export (needs {CONFIG} and {WEIGHTS})")
    model = DFlashDrafter(spec_from_hf_config(json.loads((p / CONFIG).read_text())))
    model.load_state_dict(load_file(str(p / WEIGHTS)), strict=True)
    return model.to(device=device, dtype=dtype).eval()


def read_meta(path: str | Path) -> dict[str, Any]:
    """dflash_meta.json of an export ({} when it has none or it cannot be read)."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def spec_of_export(path: str | Path) -> DraftSpec:
    p = Path(path) / CONFIG
    if not p.is_file():
        raise ConfigError(f"{Path(path)} is not a drafter export (needs {CONFIG} and {WEIGHTS})")
    return spec_from_hf_config(json.loads(p.read_text()))


def update_meta(path: str | Path, **entries: Any) -> None:
    """Merge entries (e.g. the acceptance-length evaluation) into dflash_meta.json."""
    f = Path(path) / META
    meta = json.loads(f.read_text()) if f.exists() else {}
    meta.update(entries)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str))
    as_made(tmp)
    os.replace(tmp, f)
