"""Quantized targets: checkpoints whose config.json carries a `quantization_config` (the FP8 checkpoints users
serve, e.g. Qwen's block-wise FP8: `quant_method: fp8`, `weight_block_size: [128, 128]`, e4m3 weights with a float32
`weight_scale_inv` per block, activations quantized dynamically).

A drafter is best trained on the hidden states of the model it will sit beside, so an FP8 target runs its own FP8
forward. Where that cannot run, transformers does not refuse: it loads the checkpoint dequantized to bf16 with one
log line (on CPU, on GPUs before compute capability 8.9), which would store states of another forward than the one
served. The probe decides instead (`target.quantization`):
- "auto": the checkpoint's own quantized forward, refused with the reason where it cannot run here;
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
    if scale_fmt != "float":
        raise CompatError(
            f"{model_path}/config.json: {field}.scale_fmt={scale_fmt!r} is not supported (supported: 'float', "
            "float32 weight_scale_inv per block as Qwen publishes them)"
        )
    return {
        "field": field,
        "method": method,
        "weight_block_size": list(block) if block is not None else None,
        "activation_scheme": q.get("activation_scheme", "dynamic"),
        "scale_fmt": scale_fmt,
        "modules_to_not_convert": list(q.get("modules_to_not_convert") or q.get("ignored_layers") or []),
    }


def fp8_forward_problem(devices: list[str]) -> tuple[str, str] | None:
    """Why the checkpoint's FP8 forward cannot run on `devices` with the installed libraries, and the fix (None:
    it can)."""
    other = "or set target.quantization=dequantize"
    if not all(d.startswith("cuda") for d in devices):
        return f"it needs CUDA GPUs and the run is on {', '.join(devices)}", f"run on GPUs (extract.devices) {other}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU", f"run where torch sees the GPUs {other}"
    for d in devices:
        cap = torch.cuda.get_device_capability(torch.device(d))
        if cap < FP8_MIN_CAPABILITY:
            return (
                f"{d} ({torch.cuda.get_device_name(torch.device(d))}) has compute capability {cap[0]}.{cap[1]}; FP8 "
                f"tensor cores need {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer",
                f"run on L4/L40, H100, H200 or newer GPUs {other}",
            )
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError as e:
        return f"this transformers has no fine-grained FP8 support ({e})", f"upgrade transformers {other}"
    load = getattr(finegrained_fp8, "load_finegrained_fp8_kernel", None)
    if load is not None:  # transformers >= 5.17 takes the FP8 matmul from the `kernels` package's hub kernel
        try:
            load()
        except Exception as e:  # noqa: BLE001 - any failure to get the kernel means: cannot run here
            return (
                f"transformers' FP8 matmul kernel (kernels-community/finegrained-fp8, fetched from the Hugging Face "
                f"Hub by the `kernels` package) could not be loaded: {type(e).__name__}: {e}",
                "install the `kernels` version this transformers names (its message above says which) and, on a "
                f"machine without internet, fetch the kernel into the Hugging Face cache beforehand, {other}",
            )
    elif importlib.util.find_spec("triton") is None:
        return "transformers' FP8 matmul is a Triton kernel and triton is not installed", f"pip install triton {other}"
    return None


def resolve(quant: dict | None, setting: str, devices: list[str], model_path: str) -> dict | None:
    """The quantization record of the run (the checkpoint's, plus `forward`: "fp8" or "dequantized"), or None for
    an unquantized checkpoint. `setting` is target.quantization."""
    if quant is None:
        return None
    if importlib.util.find_spec("accelerate") is None:  # transformers' FP8 loader needs it, dequantizing too
        raise CompatError(
            f"{model_path} is an FP8 checkpoint (config.json quantization_config) and transformers loads those only "
            "with accelerate installed: pip install 'dflash-pipeline[fp8]'"
        )
    if setting == "dequantize":
        return {**quant, "forward": "dequantized"}
    problem = fp8_forward_problem(devices)
    if problem:
        raise CompatError(
            f"{model_path} is an FP8 checkpoint (config.json {quant['field']}: quant_method fp8, weight_block_size "
            f"{quant['weight_block_size']}) and its FP8 forward cannot run here: {problem[0]}. Fix: {problem[1]} "
            "(extracts from its weights dequantized to the compute dtype: states of another forward than the FP8 "
            "model's; the store records it)"
        )
    return {**quant, "forward": "fp8"}


def load_kwargs(quant: dict | None) -> dict:
    """from_pretrained keywords for the resolved quantization: the dequantizing config, or nothing."""
    if not quant or quant["forward"] != "dequantized":
        return {}
    from transformers import FineGrainedFP8Config

    block = quant["weight_block_size"]
    return {
        "quantization_config": FineGrainedFP8Config(
            dequantize=True,
            weight_block_size=tuple(block) if block else None,
            activation_scheme=quant["activation_scheme"],
            modules_to_not_convert=quant["modules_to_not_convert"] or None,
        )
    }


FP8_TORCH_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def finish_loaded(model, quant: dict | None, dtype: torch.dtype, model_path: str) -> None:
    """Check that the loaded model runs the forward the probe chose (FP8 weights for "fp8", none left for
    "dequantized"), then give every other floating tensor the compute dtype: transformers 5.17's FP8 loader keeps
    the checkpoint's stored dtype for the unquantized tensors of a multimodal checkpoint, and a forward mixing
    bf16 and float32 fails at its first matmul."""
    if not quant:
        return
    fp8 = [n for n, p in model.named_parameters() if p.dtype in FP8_TORCH_DTYPES]
    if quant["forward"] == "fp8" and not fp8:
        raise CompatError(
            f"{model_path}: the probe chose the FP8 forward but transformers loaded no FP8 weights (it dequantized "
            "the checkpoint); set target.quantization=dequantize to extract from the dequantized weights knowingly"
        )
    if quant["forward"] == "dequantized" and fp8:
        raise CompatError(
            f"{model_path}: target.quantization=dequantize, yet transformers kept {len(fp8)} tensors in FP8 (first: "
            f"{fp8[0]}): this transformers cannot dequantize the checkpoint; extract from its unquantized checkpoint"
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.dtype not in FP8_TORCH_DTYPES and t.dtype != dtype:
            if not name.endswith(("weight_scale_inv", "activation_scale")):  # the FP8 kernels' float32 scales
                t.data = t.data.to(dtype)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """float32 weight of an e4m3 `weight` [N, K] and its `weight_scale_inv` (per [bn, bk] block; a scalar for
    per-tensor): the reference the dequantized load must match."""
    w = weight.float()
    if block is None or scale_inv.ndim == 0:
        return w * scale_inv.float()
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
    return w * s


def quantize_fp8_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 of a 2-D weight: (weight fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]) with scale_inv =
    block absmax / 448, the published format (edge blocks cover what is left)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    t = padded.reshape(rows, bn, cols, bk)
    scale = (t.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (t / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows * bn, cols * bk)[:n, :k].contiguous(), scale


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
