"""Quantized targets: checkpoints whose config.json carries a `quantization_config` (the FP8 checkpoints users
serve, e.g. Qwen's block-wise FP8: `quant_method: fp8`, `weight_block_size: [128, 128]`, e4m3 weights with a float32
`weight_scale_inv` per block, activations quantized dynamically).

A drafter is best trained on the hidden states of the model it will sit beside, so an FP8 target runs its own FP8
forward. transformers alone would not: where its FP8 matmul cannot run (CPU, GPUs before compute capability 8.9,
and any machine that cannot fetch its hub kernel) it loads the checkpoint dequantized to bf16 with one log line,
states of another forward than the one served. The probe decides instead (`target.quantization`):
- "auto": the checkpoint's FP8 forward (extraction/fp8_linear.py): its stored e4m3 weights and block scales, inputs
  quantized per token and 128 channels; torch's FP8 GEMM where the GPU has one, else emulated (same states, slow);
- "dequantize": the weights dequantized once at load (weight x scale per block) and run in the compute dtype; the
  store says so, and validation recomputes the same way.

`quantize_fp8_checkpoint` writes the published format from a bf16/fp32 checkpoint (benchmarks and tests build FP8
targets with it; no FP8 checkpoint can be downloaded on our machines).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.errors import CompatError

SUPPORTED_METHODS = ("fp8",)
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with FP8 tensor cores
E4M3_MAX = 448.0


def checkpoint_quantization(model_config: dict, model_path: str) -> dict[str, Any] | None:
    """The checkpoint's quantization (None: not quantized), normalized: the config field it sits in, method,
    weight_block_size, activation_scheme, scale_fmt, modules_to_not_convert. A format this pipeline cannot run is an
    error naming the field."""
    q, field = model_config.get("quantization_config"), "quantization_config"
    if q is None and isinstance(model_config.get("text_config"), dict):
        q, field = model_config["text_config"].get("quantization_config"), "text_config.quantization_config"
    if q is None:
        return None
    method = q.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise CompatError(
            f"{model_path}/config.json: {field}.quant_method={method!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_METHODS)}, block-wise as transformers' fine-grained FP8 reads it); extract from "
            "the unquantized checkpoint instead"
        )
    block, scale_fmt = q.get("weight_block_size"), q.get("scale_fmt", "float")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise CompatError(
            f"{model_path}/config.json: {field}.activation_scheme={q['activation_scheme']!r} is not supported "
            "(supported: 'dynamic', inputs quantized per token and 128 channels as Qwen's FP8 checkpoints do)"
        )
    if block is None or len(block) != 2:
        raise CompatError(
            f"{model_path}/config.json: {field}.weight_block_size={block!r}: only block-wise FP8 (e.g. [128, 128]) "
            "is supported"
        )
    if scale_fmt != "float":
        raise CompatError(
            f"{model_path}/config.json: {field}.scale_fmt={scale_fmt!r} is not supported (supported: 'float', "
            "float32 weight_scale_inv per block as Qwen publishes them)"
        )
    return {
        "field": field,
        "method": method,
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
        "scale_fmt": scale_fmt,
        "modules_to_not_convert": list(q.get("modules_to_not_convert") or q.get("ignored_layers") or []),
    }


def fp8_matmul(devices: list[str], block: list[int] | None) -> str:
    """How the FP8 linears will multiply on `devices`: "scaled_mm" (torch's block-scaled FP8 GEMM, 128 x 128 weight
    blocks, checked against the emulation on each GPU) or "emulated" (same quantized values, float32 product: same
    states, no speed-up)."""
    from dflash_pipeline.extraction import fp8_linear

    gpus = [torch.device(d) for d in devices if d.startswith("cuda")]
    if block != [128, 128] or len(gpus) != len(devices) or not torch.cuda.is_available():
        return "emulated"
    return "scaled_mm" if all(fp8_linear.fast_path_ok(g) for g in gpus) else "emulated"


def resolve(quant: dict | None, setting: str, devices: list[str], model_path: str) -> tuple[dict | None, list[str]]:
    """The quantization record of the run (the checkpoint's, plus `forward`: "fp8" or "dequantized", and for "fp8"
    `fp8_matmul`) and the probe's warnings; (None, []) for an unquantized checkpoint. `setting`: target.quantization."""
    if quant is None:
        return None, []
    if importlib.util.find_spec("accelerate") is None:  # transformers' FP8 loader needs it, dequantizing too
        raise CompatError(
            f"{model_path} is an FP8 checkpoint (config.json {quant['field']}) and transformers loads those only "
            "with accelerate installed: pip install 'dflash-pipeline[fp8]'"
        )
    if setting == "dequantize":
        return {**quant, "forward": "dequantized"}, []
    matmul = fp8_matmul(devices, quant["weight_block_size"])
    warnings = []
    if matmul == "emulated":
        warnings.append(
            f"{model_path} is an FP8 checkpoint and {', '.join(devices)} cannot run FP8 GEMMs (they need CUDA GPUs of "
            f"compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} and 128x128 weight blocks): its "
            "FP8 forward runs emulated, the same quantized values multiplied in float32 (the states the FP8 model "
            "computes, without its speed)"
        )
    return {**quant, "forward": "fp8", "fp8_matmul": matmul}, warnings


def load_kwargs(quant: dict | None) -> dict:
    """from_pretrained keywords for a quantized checkpoint: always the dequantizing load (the FP8 forward then
    puts the stored FP8 weights back, extraction/fp8_linear.py: transformers' own FP8 matmul comes from a hub
    kernel an offline machine cannot fetch)."""
    if not quant:
        return {}
    from transformers import FineGrainedFP8Config

    return {
        "quantization_config": FineGrainedFP8Config(
            dequantize=True,
            weight_block_size=tuple(quant["weight_block_size"]),
            activation_scheme=quant["activation_scheme"],
            modules_to_not_convert=quant["modules_to_not_convert"] or None,
        )
    }


FP8_TORCH_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def finish_loaded(model, quant: dict | None, dtype: torch.dtype, model_path: str) -> None:
    """Make the loaded (dequantized) model run the forward the probe chose: for "fp8" the checkpoint's stored FP8
    weights back in place of its linears (extraction/fp8_linear.py). Then give every other floating tensor the
    compute dtype: transformers 5.17's FP8 loader keeps the stored dtype of a multimodal checkpoint's unquantized
    tensors, and a forward mixing bf16 and float32 fails at its first matmul."""
    if not quant:
        return
    fp8 = [n for n, p in model.named_parameters() if p.dtype in FP8_TORCH_DTYPES]
    if fp8:
        raise CompatError(
            f"{model_path}: transformers kept {len(fp8)} tensors in FP8 (first: {fp8[0]}) where it was asked to "
            "dequantize the checkpoint: this transformers cannot load it; extract from its unquantized checkpoint"
        )
    if quant["forward"] == "fp8":
        from dflash_pipeline.extraction import fp8_linear

        if fp8_linear.install(model, model_path, quant["weight_block_size"]) == 0:
            raise CompatError(f"{model_path}: quantization_config says FP8, but no weight has a weight_scale_inv")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.dtype not in FP8_TORCH_DTYPES and t.dtype != dtype:
            if not name.endswith(("weight_scale_inv", "weight_scale_mm")):  # the FP8 linears' float32 scales
                t.data = t.data.to(dtype)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> torch.Tensor:
    """float32 weight of an e4m3 `weight` [N, K] and its `weight_scale_inv` per [bn, bk] block (edge blocks cover
    what is left): the reference the dequantized load must match."""
    w = weight.float()
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
    return w * s


def to_e4m3(t: torch.Tensor, dims: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's quantization of float32 `t` in groups over `dims`: (e4m3 of t / scale, scale = group absmax /
    448, kept as size-1 dims). Weights (per block) and activations (per token and 128 channels) alike."""
    scale = (t.abs().amax(dim=dims, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 of a 2-D weight: (weight fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]) with scale_inv =
    block absmax / 448, the published format (edge blocks cover what is left)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    q, scale = to_e4m3(padded.reshape(rows, bn, cols, bk), (1, 3))
    return q.reshape(rows * bn, cols * bk)[:n, :k].contiguous(), scale.reshape(rows, cols)


def quantize_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy the checkpoint at `src` to `dst` with every 2-D linear weight of its decoder layers that `block` divides
    stored block-wise FP8 (the others, embeddings, norms and lm_head kept and listed in modules_to_not_convert), and
    the matching quantization_config in config.json. Single-file safetensors checkpoints (what the benchmarks and
    tests build)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{src}: quantize_fp8_checkpoint reads a single model.safetensors; none is there")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    state = load_file(weights)
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, w in state.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and w.ndim == 2 and ".layers." in name and "norm" not in name
        if linear and w.shape[0] % block[0] == 0 and w.shape[1] % block[1] == 0:
            out[name], out[f"{module}.weight_scale_inv"] = quantize_fp8_weight(w, block)
        else:
            out[name] = w
            if name.endswith(".weight") and w.ndim == 2:
                skipped.append(module)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "modules_to_not_convert": sorted(skipped),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
