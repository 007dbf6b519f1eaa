"""The parts of the target the drafter borrows: token embedding, final norm and lm_head (frozen), and the
draft architecture derived from the target's config.

Training needs only these three tensors, so they are read straight from the safetensors files (a few
hundred MB for an 8B model, instead of loading all 16 GB). The norm module is instantiated from the
target's own class on the meta device, because norms differ between families (Qwen3.5 scales by
1 + weight, Qwen3 by weight); distillation logits must match the target's exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.model import FULL, SLIDING, DraftSpec
from dflash_pipeline.errors import CompatError, ConfigError
from dflash_pipeline.extraction import quantized
from dflash_pipeline.extraction.modelfiles import read_model_config

if TYPE_CHECKING:
    from dflash_pipeline.extraction.probe import ProbeReport

log = logging.getLogger(__name__)


class TargetHead(nn.Module):
    """Frozen embed / final norm / lm_head of the target. Never part of the drafter's state_dict."""

    def __init__(self, embed: nn.Module, norm: nn.Module | None, lm_head: nn.Module):
        super().__init__()
        self.embed, self.norm, self.lm_head = embed, norm, lm_head  # norm: None when not loaded
        self.requires_grad_(False)

    def logits(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(draft_hidden)

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its last decoder layer's pre-norm output."""
        assert self.norm is not None, "load_target_head(need_norm=True) is needed for the target's logits"
        return self.lm_head(self.norm(last_hidden))


def head_from_model(model) -> TargetHead:
    """From an already loaded HF causal LM (evaluation)."""
    return TargetHead(model.get_input_embeddings(), _final_norm(model), model.get_output_embeddings())


def _final_norm(model) -> nn.Module:
    base = getattr(model, "model", None) or model.get_decoder()
    norm = getattr(base, "norm", None)
    if norm is None:
        raise ConfigError(
            f"{type(model).__name__} has no model.norm; the drafter needs the target's final "
            "norm for distillation and evaluation"
        )
    return norm


def _read_tensors(model_path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors, in float: an FP8 checkpoint's quantized ones (if it quantized its embedding or lm_head
    too) dequantized with their block scales, wherever in the shards those sit."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))

    def read(wanted: set[str]) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for n in wanted & set(fh.keys()):
                    got[n] = fh.get_tensor(n)
        return got

    out = read(set(names))
    fp8 = [n for n, t in out.items() if t.dtype in quantized.FP8_TORCH_DTYPES]
    if fp8:
        quant = quantized.checkpoint_quantization(read_model_config(model_path), model_path)
        scales = read({n.removesuffix("weight") + "weight_scale_inv" for n in fp8})
        for n in fp8:
            scale = n.removesuffix("weight") + "weight_scale_inv"
            if quant is None or scale not in scales:
                raise CompatError(f"{model_path}: {n} is stored as {out[n].dtype} without {scale}: cannot read it")
            out[n] = quantized.dequantize_fp8(out[n], scales[scale], quant["weight_block_size"])
    return out


def _by_suffix(model_path: str) -> dict[str, str] | None:
    """Names of the embedding and lm_head tensors when the usual HF names make them unambiguous."""
    from dflash_pipeline.extraction.modelfiles import safetensors_header

    keys = [k for f in sorted(Path(model_path).glob("*.safetensors")) for k in safetensors_header(f)]
    emb = [k for k in keys if k.endswith("embed_tokens.weight")]
    head = [k for k in keys if k == "lm_head.weight"]
    mc = read_model_config(model_path)
    tied = (mc.get("text_config") or mc).get("tie_word_embeddings", mc.get("tie_word_embeddings", False))
    if len(emb) != 1 or not (head or tied):
        return None
    return {"embed": emb[0], "lm_head": head[0] if head else emb[0]}


def load_target_head(
    report: ProbeReport, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, need_norm: bool = True
) -> TargetHead:
    """The target's embedding, final norm and lm_head, from the checkpoint `report` describes.

    Without `need_norm` (no distillation) the target's modeling code is not even imported: the two matrices
    are found by their usual names. Otherwise the module names come from a meta skeleton."""
    model_path = report.model_path
    if not need_norm and (names := _by_suffix(model_path)):
        t = _read_tensors(model_path, list(names.values()))
        embed = nn.Embedding.from_pretrained(t[names["embed"]], freeze=True)
        head = nn.Linear(t[names["lm_head"]].shape[1], t[names["lm_head"]].shape[0], bias=False)
        head.weight.data = t[names["lm_head"]]
        return TargetHead(embed, None, head).to(device=device, dtype=dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=report.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    modules = {
        "embed": skeleton.get_input_embeddings(),
        "norm": _final_norm(skeleton),
        "lm_head": skeleton.get_output_embeddings(),
    }
    qual = {id(m): n for n, m in skeleton.named_modules()}
    keys = {k: f"{qual[id(m)]}.weight" for k, m in modules.items()}
    found = _read_tensors(model_path, list(keys.values()))
    if keys["lm_head"] not in found and keys["embed"] in found and getattr(config, "tie_word_embeddings", False):
        found[keys["lm_head"]] = found[keys["embed"]]
    if set(keys.values()) - set(found):  # unusual key layout: let transformers map it, load everything
        log.info("target head tensors %s not found by name; loading the whole target", set(keys.values()) - set(found))
        from dflash_pipeline.extraction.loader import load_planned

        full = load_planned(report, "cpu", str(dtype).removeprefix("torch."))
        return head_from_model(full).to(device)
    for k, m in modules.items():
        m.to_empty(device="cpu")
        m.load_state_dict({"weight": found[keys[k]]}, strict=False)
    return TargetHead(modules["embed"], modules["norm"], modules["lm_head"]).to(device=device, dtype=dtype)


def mask_token_id(tokenizer, mask_token: str | int, vocab_size: int) -> int:
    if isinstance(mask_token, int):
        tid = mask_token
    else:
        tid = tokenizer.convert_tokens_to_ids(mask_token)
        if tid is None or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(tid) != mask_token:
            raise ConfigError(
                f"train.mask_token={mask_token!r} is not a single token of the tokenizer; give "
                "an existing special token or a token id inside the embedding (e.g. one past "
                "the tokenizer's vocabulary)"
            )
    if not 0 <= tid < vocab_size:
        raise ConfigError(f"train.mask_token id {tid} is outside the target's embedding (vocab_size {vocab_size})")
    return int(tid)


def draft_spec(model_path: str, layer_ids: list[int], cfg: TrainConfig, mask_id: int) -> DraftSpec:
    """Draft layers mirror the target's attention shape (hidden, heads, head_dim, MLP width)."""
    mc = read_model_config(model_path)
    t = mc.get("text_config") or mc
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    n = cfg.num_draft_layers or len(layer_ids)
    types = [FULL] * n
    if cfg.sliding_window is not None:
        chosen = range(n) if cfg.sliding_layers is None else cfg.sliding_layers
        bad = [i for i in chosen if i >= n]
        if bad:
            raise ConfigError(
                f"train.sliding_layers={cfg.sliding_layers} names layer(s) {bad}, but the drafter "
                f"has {n} layers (train.num_draft_layers)"
            )
        for i in chosen:
            types[i] = SLIDING
    rope = t.get("rope_parameters") or {}
    return DraftSpec(
        hidden_size=hidden,
        intermediate_size=int(t.get("intermediate_size", 4 * hidden)),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads", heads)),
        head_dim=int(t.get("head_dim") or hidden // heads),
        num_hidden_layers=n,
        vocab_size=int(t["vocab_size"]),
        target_layer_ids=list(layer_ids),
        num_target_layers=int(t["num_hidden_layers"]),
        block_size=cfg.block_size,
        mask_token_id=mask_id,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or t.get("rope_theta") or 1_000_000.0),
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        sliding_window=cfg.sliding_window,
        layer_types=types,
    )


def spec_json(spec: DraftSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True)
