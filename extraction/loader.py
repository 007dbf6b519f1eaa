"""Load the target for inference through the probed dtype keyword."""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction import quantized
from dflash_pipeline.extraction.kernels import use_conv_kernel, use_gdn_forward
from dflash_pipeline.extraction.placement import device_map_summary, replica_devices, split_device_map

if TYPE_CHECKING:
    from dflash_pipeline.extraction.probe import ProbeReport

log = logging.getLogger(__name__)


def load_target(
    model_path: str,
    dtype_kwarg: str,
    dtype: str,
    device: str,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    working_bytes: float = 0.0,
    max_gpu_memory_gib: float | None = None,
    quantization: dict | None = None,
):
    """An eval-mode causal LM on `device`, gradients off. Missing or corrupt files raise CompatError.

    `device` may be a split replica ("cuda:0+cuda:1", target/placement.py): the decoder layers are then
    spread over those GPUs in proportion to their free memory (capped at `max_gpu_memory_gib`), less
    `working_bytes` kept free on each for activations. `quantization`: the probe's record for a quantized
    checkpoint (extraction/quantized.py), whose forward the loaded model is checked to run."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    kwargs = {dtype_kwarg: getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    kwargs |= quantized.load_kwargs(quantization)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    devices = replica_devices(device)
    if len(devices) > 1:
        cap = (max_gpu_memory_gib or float("inf")) * 2**30
        room = [min(torch.cuda.mem_get_info(torch.device(d))[0], cap) - working_bytes for d in devices]
        kwargs["device_map"] = split_device_map(model_path, devices, room)
        log.info("%s split across %s (%s)", model_path, device, device_map_summary(kwargs["device_map"]))
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:
        raise CompatError(
            f"cannot load the target from {model_path}: {type(e).__name__}: {e}. "
            "Check that the directory holds a complete checkpoint (config.json and all weight "
            "files) and re-download it if a file is truncated"
        ) from e
    quantized.finish_loaded(model, quantization, getattr(torch, dtype), model_path)
    if len(devices) == 1:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    return model


def load_planned(report: ProbeReport, device: str, dtype: str | None = None):
    """The target as the probe planned it: its path, dtype keyword, compute dtype (unless `dtype` is given),
    attention implementation and trust_remote_code, and on a split replica the same working-memory reserve
    and per-GPU cap. Every stage that runs the target loads it here."""
    use_conv_kernel(report.conv_kernel)
    model = load_target(
        report.model_path,
        report.dtype_kwarg,
        dtype or report.compute_dtype,
        device,
        report.attn_implementation,
        trust_remote_code=report.trust_remote_code,
        working_bytes=report.working_gib * 2**30,
        max_gpu_memory_gib=report.max_gpu_memory_gib,
        quantization=report.quantization,
    )
    gpu = any(d.startswith("cuda") for d in replica_devices(device))  # (a CPU copy never runs fla's kernels)
    fused = use_gdn_forward(model, report.gdn_forward if gpu else "transformers")
    if gpu and report.gdn_forward == "fused" and not fused:  # a transformers whose layers are built otherwise
        log.warning(
            "extract.gdn_forward=fused: no Gated DeltaNet layer of %s has the projections the fused forward "
            "reads (transformers %s); transformers' forward runs",
            report.model_type,
            report.transformers_version,
        )
    return model


def load_compiled(report: ProbeReport, device: str, compile_mode: str) -> tuple[torch.nn.Module, str, int]:
    """load_planned, then extract.compile as resolved for `device`: (model, mode, modules compiled). The
    forward extraction stores and validation recomputes with. (Compiled and eager bf16 forwards of a
    36-layer dense model differ by ~2% relative at the deepest layers, near validation's 3% tolerance.)"""
    model = load_planned(report, device)
    gpus = [d for d in replica_devices(device) if d.startswith("cuda")]
    mode = resolve_compile(compile_mode, bool(gpus), report.layer_types, split=len(gpus) > 1)
    return model, mode, compile_modules(model, mode)


def decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if layers is None:
        raise CompatError(
            f"{type(model).__name__} has no model.layers: hidden-state capture supports "
            "decoder-only models with a `layers` ModuleList"
        )
    return layers


def base_model(model):
    """The decoder stack without lm_head (calling it skips the vocabulary projection)."""
    base = getattr(model, "model", None)
    return base if base is not None else model.get_decoder()


COMPILE_MODES = ("off", "norms", "parts", "layers")


def resolve_compile(mode: str, cuda: bool, layer_types: list[str], split: bool = False) -> str:
    """'auto' on a GPU with torch.compile's GPU backend (triton): 'layers' when every decoder layer is softmax
    attention (8B shape on one H200: forward 32.5k -> 42.2k tokens/s, bench/RESULTS.md), 'parts' for a
    hybrid, whose linear-attention layers call flash-linear-attention's own kernels (whole-layer compiling
    did not finish within 4 minutes on the 27B shape; norms alone: 8.5k -> 9.2k tokens/s). A `split` replica
    (layers on several GPUs behind accelerate's hooks) gets 'norms'. Else 'off'."""
    if mode != "auto":
        return mode
    if not cuda or importlib.util.find_spec("triton") is None:
        return "off"
    if split:
        return "norms"
    return "parts" if "linear_attention" in layer_types else "layers"


def is_compile_error(e: BaseException) -> bool:
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def forward_or_eager(model, fn):
    """fn(); if torch.compile fails inside it, the compiled modules go back to eager (with a warning) and
    fn runs again."""
    try:
        return fn()
    except RuntimeError as e:
        if not is_compile_error(e):
            raise
        log.warning(
            "torch.compile failed (%s: %s); continuing with the eager forward (set extract.compile: "
            "off to skip the attempt)",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        compile_modules(model, "off")
        return fn()


def compile_modules(model, mode: str) -> int:
    """torch.compile parts of the target in place, so their elementwise work runs as fused kernels:
    'norms' every RMSNorm module, gated ones too (in an eager forward each is ~6-10 kernels, each reading and
    writing the activations), 'parts' the norms and each decoder layer's MLP (its activation and product
    fused into one kernel between the matmuls), 'layers' every decoder layer whole; 'off' restores the eager
    forwards. Returns how many modules are now compiled. Idempotent: a module is compiled once whatever the
    number of calls."""
    assert mode in COMPILE_MODES, mode
    from dflash_pipeline.extraction import fp8_linear

    fp8_linear.compile_quantization(mode != "off")
    if mode == "layers" and any(isinstance(m, fp8_linear.BlockFP8Linear) for m in model.modules()):
        # an FP8 target's GEMMs run outside the graph: a whole layer would break at every linear
        log.info("extract.compile: 'parts' for an FP8 target instead of 'layers'")
        mode = "parts"
    if mode in ("norms", "parts"):
        want = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))]
        if mode == "parts":
            # dense MLPs only: a mixture-of-experts block routes tokens with data-dependent shapes
            # (not an FP8 target's: its GEMMs run outside the graph, which then breaks at each linear, leaving
            # nothing fused, and its gate and up projections could no longer share their input's quantization)
            want += [
                layer.mlp
                for layer in decoder_layers(model)
                if type(getattr(layer, "mlp", None)).__name__.endswith("MLP")
                and not any(isinstance(m, fp8_linear.BlockFP8Linear) for m in layer.mlp.modules())
            ]
    elif mode == "layers":
        want = list(decoder_layers(model))
        # Layers may differ in guarded attributes (layer index, attention type): room for one graph each.
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 2 * len(want)))
    else:
        want = []
    keep = {id(m) for m in want}
    for m in model.modules():
        if hasattr(m, "_dflash_eager_forward") and id(m) not in keep:
            eager = m._dflash_eager_forward  # accelerate's hook on a split replica, or None: the class's forward
            del m._dflash_eager_forward
            if eager is None:
                del m.forward
            else:
                m.forward = eager
    for m in want:
        if not hasattr(m, "_dflash_eager_forward"):
            m._dflash_eager_forward = vars(m).get("forward")
            m.forward = torch.compile(m.forward, dynamic=True)  # one graph for every batch shape
    return len(want)
