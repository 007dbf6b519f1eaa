"""A drafter trained by vLLM's `speculators` (0.9.0, `speculators train --speculator-type dflash`) in our export format
(drafter/export.py: z-lab's, which vLLM, SGLang, z-lab's `dflash` and our evaluator load).

What speculators' trainer saves (speculators/train/checkpointer.py): `SAVE_PATH/<epoch>/` per checkpoint (epoch 0, 1,
...; `checkpoint_best` a symlink to one of them with --save-best), each holding `save_pretrained`'s `config.json` (a
`DFlashSpeculatorConfig`: `speculators_model_type: dflash`, `transformer_layer_config` a Qwen3 config as a diff
from Qwen3Config's defaults, `aux_hidden_state_layer_ids`, `block_size`, `mask_token_id`, `draft_vocab_size`,
`sample_from_anchor`, `sliding_window_non_causal`, `speculators_config.verifier`) and `model.safetensors` (bf16 by
default) with the draft body only: `fc.weight`, `hidden_norm.weight`, `layers.{i}.*`, `norm.weight`. The embedding,
lm_head, verifier norm and verifier lm_head are the verifier's and are not saved (`_keys_to_ignore_on_save`), except a
reduced-vocabulary `lm_head.weight` (with `t2d` / `d2t`) when it trained with `--draft-vocab-size`.

The mapping (models/dflash/core.py, model_definitions.py against drafter/model.py):
- weights: the same names and shapes (speculators' converter of z-lab checkpoints copies them as they are); Qwen3
  RMSNorms (x / rms * weight) both; attention q/k/v/o without bias, q_norm/k_norm per head before the rotary, the
  context's k/v from `fc`+`hidden_norm` of the concatenated layers ahead of the block's own; the full head dim
  rotated with the verifier's rope_theta (speculators' trainer drops a partial_rotary_factor).
- layer ids: speculators' `aux_hidden_state_layer_ids` count the embeddings as 0 (vLLM's numbering); ours are
  decoder-layer indices, so ours = theirs - 1 (their id `num_layers`, the last decoder layer's output, is ours
  `num_layers - 1`). `fc`'s input blocks are in the order the training data gave them (export-states: the store's
  layer order), which is the order of the ids in the config when --target-layer-ids was given as export-states
  printed it.
- embedding and lm_head: both trainers use the target's, frozen; nothing to carry.
- block: `block_size` positions, the anchor then block_size - 1 mask tokens (`mask_token_id`), position k predicting
  token anchor + k: that is speculators' `sample_from_anchor: false` (its DFlash default); `true` (DSpark's) predicts
  one token later at every position and has no place in this format: refused.
- sliding-window layers (`layer_types` + `sliding_window`; speculators' DFlash default: every draft layer, window
  2048): causal inside the block, as ours and z-lab's (`sliding_window_non_causal: false`, its DFlash default;
  `true`, DFlash2's, is refused). The window itself: at inference (z-lab, vLLM, our evaluator) query position p sees
  keys p - window < j <= p; speculators' training mask lets every position of a block see the context back to
  anchor - window. Identical while the context is shorter than the window; beyond it the first positions of a
  block see up to block_size - 1 fewer of the farthest context tokens than they trained with.

Refused, with the file and key: a reduced draft vocabulary, a rope other than the default (scaling, mrope, partial),
attention bias, an activation other than silu, a hidden size unlike the target's, an aux layer id 0 (the embeddings)
or past the target's layers, weights missing or left over.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.drafter.model import FULL, SLIDING, DFlashDrafter, DraftSpec

log = logging.getLogger(__name__)

CONFIG, WEIGHTS = "config.json", "model.safetensors"
# what speculators' DFlash checkpoints may hold beside the draft body: the verifier's, reconstructed on load
VERIFIER_KEYS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def checkpoint_dir(path: str | Path, epoch: str | None = None) -> Path:
    """The checkpoint directory in `path`: `path` itself when it holds config.json, else speculators' save path's
    `epoch` (a number or `checkpoint_best`), by default the highest-numbered epoch (the last one trained)."""
    p = Path(path)
    if epoch is not None:
        p = p / str(epoch)
    if (p / CONFIG).is_file():
        return p
    if not p.is_dir():
        raise ValueError(f"{p}: no such directory (give a speculators checkpoint directory or its --save-path)")
    epochs = sorted((int(d.name) for d in p.iterdir() if d.name.isdigit() and (d / CONFIG).is_file()), reverse=True)
    if not epochs:
        raise ValueError(
            f"{p} holds neither {CONFIG} nor numbered epoch directories with one: give a checkpoint directory "
            "(SAVE_PATH/<epoch>) or the --save-path of a `speculators train` run that saved a checkpoint"
        )
    return p / str(epochs[0])


def _target_config(target: str | Path) -> dict[str, Any]:
    """The target's language-model config: every dimension the conversion reads, as positive integers, or an error
    naming its config.json."""
    from dflash_pipeline.extraction.probe import text_config

    f = Path(target) / CONFIG
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: cannot read the target's config ({e}); --target is the target model's directory") from e
    return text_config(cfg, str(target))


def _check_out(out: Path, ckpt: Path, target: str | Path) -> None:
    """The export replaces `out` whole: refuse a directory that is not an earlier export, or one that is (or holds)
    the checkpoint or the target."""
    o = out.resolve()
    for name, keep in (("the checkpoint", ckpt.resolve()), ("its --save-path", ckpt.resolve().parent),
                       ("the target", Path(target).resolve())):  # fmt: skip
        if o == keep or o in keep.parents:
            raise ValueError(f"{out} is {name} or holds it ({keep}): give a new directory for the export")
    if o.exists() and not (o / "dflash_meta.json").is_file():
        raise ValueError(
            f"{out} exists and is not an earlier export (no dflash_meta.json): the export would replace it whole; "
            "give a new directory, or delete this one first"
        )


def _layer_config(tl: dict[str, Any]):
    """speculators saves transformer_layer_config as a diff from its class's defaults: rebuild the whole config
    the way its DFlashSpeculatorConfig does (the class named by model_type, Qwen3Config without one)."""
    from transformers import AutoConfig
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    tl = dict(tl)
    model_type = tl.pop("model_type", None)
    return AutoConfig.for_model(model_type, **tl) if model_type else Qwen3Config(**tl)


def _rope_theta(c, where: str) -> float:
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if "sliding_attention" in rope or "full_attention" in rope:
        rope = rope.get("sliding_attention") or rope.get("full_attention")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    partial = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None)) or 1.0
    if rope_type != "default" or "mrope_section" in rope or float(partial) != 1.0:
        raise ValueError(
            f"{where}: transformer_layer_config.rope_parameters={rope} (rope_type {rope_type!r}, "
            f"partial_rotary_factor {partial}): the DFlash export format rotates the full head dim with the default "
            "rope; train with a verifier whose rope is the default one, or convert with speculators' own tooling"
        )
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None:
        raise ValueError(f"{where}: transformer_layer_config has no rope_theta")
    return float(theta)


def spec_from_speculators(cfg: dict[str, Any], target: dict[str, Any], where: str) -> DraftSpec:
    """Our DraftSpec from a speculators DFlash config.json (`where` names it in errors) and the target's config."""
    kind = cfg.get("speculators_model_type")
    if kind != "dflash":
        raise ValueError(
            f"{where}: speculators_model_type={kind!r}; only a `--speculator-type dflash` checkpoint converts "
            "(DFlash2 / DSpark add heads this format has no place for)"
        )
    if "transformer_layer_config" not in cfg:
        raise ValueError(f"{where}: no transformer_layer_config: not a speculators DFlash config")
    c = _layer_config(cfg["transformer_layer_config"])
    n_target = int(target["num_hidden_layers"])
    h = int(c.hidden_size)
    if h != int(target["hidden_size"]) or cfg.get("target_hidden_size") not in (None, h):
        raise ValueError(
            f"{where}: hidden_size {h} (target_hidden_size {cfg.get('target_hidden_size')}) but the target's is "
            f"{target['hidden_size']}: --target must be the verifier it trained against"
        )
    vocab = int(c.vocab_size)
    if int(cfg.get("draft_vocab_size") or vocab) != vocab or vocab != int(target["vocab_size"]):
        raise ValueError(
            f"{where}: draft_vocab_size={cfg.get('draft_vocab_size')}, vocab_size={vocab}, target vocab_size="
            f"{target['vocab_size']}: a reduced draft vocabulary (t2d/d2t) has no place in the DFlash export format, "
            "whose drafter uses the target's own lm_head; train without --draft-vocab-size (the full verifier vocab)"
        )
    if cfg.get("sample_from_anchor"):
        raise ValueError(
            f"{where}: sample_from_anchor=true (block position k predicts token anchor + k + 1): the DFlash format's "
            "position k predicts token anchor + k; train with --no-sample-from-anchor (speculators' DFlash default)"
        )
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError(f"{where}: transformer_layer_config has attention_bias/mlp_bias: the format has no biases")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: transformer_layer_config.hidden_act={act!r}; the format's MLP is SiLU-gated")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux or any(not 1 <= int(i) <= n_target for i in aux):
        raise ValueError(
            f"{where}: aux_hidden_state_layer_ids={aux}: each must be 1..{n_target} (speculators counts the "
            "embeddings as 0; ours = theirs - 1 are decoder layers of the target)"
        )
    n = int(c.num_hidden_layers)
    layer_types = list(getattr(c, "layer_types", None) or [FULL] * n)
    if len(layer_types) != n or set(layer_types) - {FULL, SLIDING}:
        raise ValueError(f"{where}: transformer_layer_config.layer_types={layer_types} for {n} layers")
    window = getattr(c, "sliding_window", None) if SLIDING in layer_types else None
    if SLIDING in layer_types:
        if not window:
            raise ValueError(f"{where}: sliding_attention layers but transformer_layer_config.sliding_window={window}")
        if cfg.get("sliding_window_non_causal"):
            raise ValueError(
                f"{where}: sliding_window_non_causal=true: the format's sliding-window layers are causal inside the "
                "block; train with --no-sliding-window-non-causal (speculators' DFlash default) or --full-"
                "attention-indices for every layer"
            )
    mask = cfg.get("mask_token_id")
    if mask is None:
        raise ValueError(f"{where}: mask_token_id is null; train with --mask-token-id")
    heads = int(c.num_attention_heads)
    return DraftSpec(
        hidden_size=h,
        intermediate_size=int(c.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or h // heads),
        num_hidden_layers=n,
        vocab_size=vocab,
        target_layer_ids=[int(i) - 1 for i in aux],
        num_target_layers=n_target,
        block_size=int(cfg.get("block_size") or 8),
        mask_token_id=int(mask),
        rms_norm_eps=float(c.rms_norm_eps),
        rope_theta=_rope_theta(c, where),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", None) or 32768),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
    )


def import_speculators(
    checkpoint: str | Path, out: str | Path, target: str | Path | None = None, epoch: str | None = None
) -> Path:
    """Convert a speculators DFlash checkpoint (a checkpoint directory, or a --save-path: its last epoch, or
    `epoch`) into our export directory `out` (drafter/export.py's format, in the checkpoint's dtype). `target`: the
    target model's directory (default: the verifier path recorded in the checkpoint's config)."""
    from safetensors.torch import load_file

    from dflash_pipeline.drafter.export import export_drafter

    ckpt = checkpoint_dir(checkpoint, epoch)
    cfg_path, weights_path = ckpt / CONFIG, ckpt / WEIGHTS
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_path}: not JSON ({e})") from e
    recorded = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    target = target or recorded
    if not target:
        raise ValueError(f"{cfg_path}: no speculators_config.verifier.name_or_path: pass --target (the target model)")
    spec = spec_from_speculators(cfg, _target_config(target), str(cfg_path))
    _check_out(Path(out), ckpt, target)
    if not weights_path.is_file():
        raise ValueError(f"{weights_path}: missing (the checkpoint's weights; was its save interrupted?)")
    tensors = load_file(str(weights_path))
    for k in ("t2d", "d2t", "lm_head.weight"):
        if k in tensors:
            raise ValueError(
                f"{weights_path}: holds {k!r}: a reduced draft vocabulary, which the format cannot carry; train "
                "without --draft-vocab-size"
            )
    body = {k: v for k, v in tensors.items() if k not in VERIFIER_KEYS}
    model = DFlashDrafter(spec)
    want = model.state_dict()
    missing = sorted(set(want) - set(body))
    extra = sorted(set(body) - set(want))
    if missing or extra:
        raise ValueError(
            f"{weights_path}: weights missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, not in the format "
            f"{extra[:6]}{' ...' if len(extra) > 6 else ''} (against {cfg_path}'s shape): not a speculators DFlash "
            "checkpoint of this config"
        )
    wrong = [f"{k} {tuple(v.shape)} != {tuple(want[k].shape)}" for k, v in body.items() if v.shape != want[k].shape]
    if wrong:
        raise ValueError(f"{weights_path}: shapes unlike {cfg_path}'s: {wrong[:4]}")
    dtypes = {v.dtype for v in body.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    model.load_state_dict({k: v.float() for k, v in body.items()}, strict=True)
    meta = {
        "imported_from": {
            "format": "speculators",
            "checkpoint": str(ckpt.resolve()),
            "speculators_version": cfg.get("speculators_version"),
            "aux_hidden_state_layer_ids": cfg.get("aux_hidden_state_layer_ids"),
            "verifier": recorded,
            "target": str(target),
            "train_command": _read(ckpt / "train_command.txt") or _read(ckpt.parent / "train_command.txt"),
        },
        "target": str(target),
    }
    path = export_drafter(model, out, meta, dtype=dtype)
    log.info(
        "imported %s: %d draft layers (%s), target layers %s (speculators %s), block %d, mask token %d -> %s",
        ckpt,
        spec.num_hidden_layers,
        ", ".join(spec.layer_types),
        spec.target_layer_ids,
        cfg.get("aux_hidden_state_layer_ids"),
        spec.block_size,
        spec.mask_token_id,
        path,
    )
    return path


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None
