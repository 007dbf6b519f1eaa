"""The FP8 forward of a block-wise FP8 checkpoint, without transformers' hub kernel (which an offline GPU machine
cannot fetch): each quantized linear becomes a `BlockFP8Linear` holding the checkpoint's own e4m3 weight and its
float32 scale per [bn, bk] block, and quantizes its input the way the format's "dynamic" activation scheme does
(e4m3 per token and 128-channel group of the reduction axis, scale = group absmax / 448).

On a CUDA GPU of compute capability >= 8.9 with 128 x 128 weight blocks the product runs in torch's block-scaled
FP8 GEMM (`torch.nn.functional.scaled_mm`, scales 1x128 for the activations and 128x128 for the weight), checked
once per device against the emulation below before it is used. Everywhere else it is emulated: the same quantized
values and scales, dequantized and multiplied in float32 (the same states up to accumulation order, no speed-up).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dflash_pipeline.extraction.quantized import FP8_MIN_CAPABILITY, dequantize_fp8, quantize_fp8_weight, to_e4m3

log = logging.getLogger(__name__)
ACT_GROUP = 128  # activations: one scale per token and 128 channels of K, as the published format's kernels do
_KERNEL_OK: dict[int, bool] = {}  # per CUDA device index: the fast path matched the emulation (fast_path_ok)
_DECLINED: set = set()  # (device, rows) the kernel refused once: logged once
# (device index, dtype) -> the activation quantizer _compiled_quantize chose there; off with extract.compile=off
_QUANTIZERS: dict = {}
_COMPILE_QUANTIZE = [True]
# The last input quantized, (it, its version, (xq, xs)): q/k/v, gate/up and a Gated DeltaNet's two input projections
# read one tensor, quantized once. Cleared around every forward of a module holding FP8 linears (an attention, an
# MLP: _scope_input_cache), so reuse never reaches past one block, nor holds memory beyond it.
_LAST: list = []


def quantize_activations(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/group)]): scale = group absmax / 448."""
    m, k = x.shape
    groups = -(-k // group)
    padded = x.float()
    if groups * group != k:
        padded = torch.nn.functional.pad(padded, (0, groups * group - k))
    q, scale = to_e4m3(padded.view(m, groups, group), -1)
    return q.view(m, groups * group)[:, :k], scale.squeeze(-1)


def compile_quantization(enabled: bool) -> None:
    """Whether GPU activation quantization may run compiled (loader.compile_modules: off with extract.compile=off
    and when a compiled forward failed)."""
    _COMPILE_QUANTIZE[0] = enabled


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations, on a GPU compiled into one kernel per input width (eager it is ~6 passes over the
    activations; on the 27B shape a dynamic-shape compile of it took 24% of the FP8 forward's GPU time, this one
    5%: bench/RESULTS.md, FP8 targets, 2026-12-03), where _compiled_quantize found it bit-equal to eager. A later
    compile that fails (a new width) leaves eager for good on that device, with a warning."""
    if x.device.type != "cuda" or not _COMPILE_QUANTIZE[0] or torch.compiler.is_compiling():
        return quantize_activations(x)
    key = (_cuda_index(x.device), x.dtype)
    fn = _QUANTIZERS.get(key)
    if fn is None:
        fn = _QUANTIZERS[key] = _compiled_quantize(x.device, x.dtype)
    if fn is quantize_activations:
        return fn(x)
    torch._dynamo.maybe_mark_dynamic(x, 0)  # static K (simple indexing), any number of rows
    try:
        return fn(x)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - an inductor failure on a new width: eager gives the same values
        log.warning("compiled FP8 activation quantization failed on %s (%s): eager from now on", x.device, e)
        _QUANTIZERS[key] = quantize_activations
        return quantize_activations(x)


def _quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize of x [..., K] as [M, K], reusing the previous call's result when x is the same tensor, unchanged
    (sibling projections of one input)."""
    if torch.compiler.is_compiling():
        return _quantize(x.reshape(-1, x.shape[-1]))
    # (an inference tensor has no version counter: identity alone, within one block's forward; the transformers
    # blocks we run modify no projection's input in place, and tests/integration/test_fp8_target.py holds the
    # shared forward bit-equal to quantizing at every linear)
    version = None if x.is_inference() else x._version
    if _LAST and _LAST[0][0] is x and _LAST[0][1] == version:
        return _LAST[0][2]
    _LAST.clear()  # the previous input's quantized copy goes before this one is made
    q = _quantize(x.reshape(-1, x.shape[-1]))
    _LAST.append((x, version, q))
    return q


def _scope_input_cache(model: nn.Module) -> None:
    """Clear the shared quantization before and after every forward of each module holding FP8 linears."""
    for parent in {m for m in model.modules() if any(isinstance(c, BlockFP8Linear) for c in m.children())}:
        if not getattr(parent, "_dflash_fp8_scoped", False):
            parent.register_forward_pre_hook(lambda *_: _LAST.clear())
            parent.register_forward_hook(lambda *_: _LAST.clear())
            parent._dflash_fp8_scoped = True


def emulated_matmul(xq, xs, wq, ws, block: list[int], group: int = ACT_GROUP) -> torch.Tensor:
    """float32 x_deq @ w_deq.T of the quantized operands (the reference of the fast path)."""
    x = xq.float() * xs.repeat_interleave(group, dim=1)[:, : xq.shape[1]]
    return x @ dequantize_fp8(wq, ws, block).T


def padded_weight_scale(ws: torch.Tensor) -> torch.Tensor:
    """The weight scales [N/128, K/128] with K/128 padded to a multiple of 4: cuBLAS reads them so (the
    transposed view of this is the [K/128, N/128] column-major operand)."""
    return torch.nn.functional.pad(ws, (0, (-ws.shape[1]) % 4)).contiguous()


def _scaled_mm(xq, xs, wq, ws_padded, out_dtype: torch.dtype) -> torch.Tensor:
    """torch's block-scaled FP8 GEMM in the layouts its sm_90 path checks (aten ScaledBlas.cpp,
    _scaled_block1x128_block128x128): activation scales [M, K/128] column-major; weight scales
    (`padded_weight_scale`) [K/128, N/128] column-major; M padded to a multiple of 4 (cuBLASLt's requirement, as
    vLLM pads it)."""
    from torch.nn.functional import ScalingType, scaled_mm

    m = xq.shape[0]
    pad_m = (-m) % 4
    if pad_m:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad_m)).view(xq.dtype)
        xs = torch.nn.functional.pad(xs, (0, 0, 0, pad_m), value=1.0)
    y = scaled_mm(
        xq,
        wq.t(),
        xs.t().contiguous().t(),
        ScalingType.BlockWise1x128,
        ws_padded.t(),
        ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )
    return y[:m] if pad_m else y


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def fast_path_ok(device: torch.device) -> bool:
    """Whether torch's block-scaled FP8 GEMM runs on `device` and matches the emulation (checked once)."""
    if device.type != "cuda":
        return False
    index = _cuda_index(device)
    if index not in _KERNEL_OK:
        _KERNEL_OK[index] = _check_fast_path(torch.device("cuda", index))
    return _KERNEL_OK[index]


def _check_fast_path(device: torch.device) -> bool:
    """On shapes aligned and not (M = 5 rows, K/128 = 5 scale columns: both padded), against the emulation."""
    if torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    for m, k, n in ((256, 512, 384), (5, 640, 256)):
        x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        wq, ws = (t.to(device) for t in quantize_fp8_weight(torch.randn(n, k, generator=gen) * 0.02, (128, 128)))
        xq, xs = quantize_activations(x)
        try:
            got = _scaled_mm(xq, xs, wq, padded_weight_scale(ws), torch.float32)
        except (RuntimeError, ValueError) as e:
            log.warning("torch's block-scaled FP8 GEMM is not usable on %s (%s): FP8 linears run emulated", device, e)
            return False
        ref = emulated_matmul(xq, xs, wq, ws, [128, 128])
        err = float((got - ref).norm() / ref.norm())
        if err > 1e-3:
            log.warning(
                "torch's block-scaled FP8 GEMM on %s differs from the emulation at %dx%dx%d (rel L2 %.2e): FP8 "
                "linears run emulated",
                device,
                m,
                k,
                n,
                err,
            )
            return False
    log.info("FP8 linears on %s: torch's block-scaled FP8 GEMM", device)
    return True


def _compiled_quantize(device: torch.device, dtype: torch.dtype):
    """quantize_activations compiled, if it compiles and quantizes bit-equal to eager on `device` in `dtype` (row
    counts and a width not multiples of 128, a zero row, six decades of magnitude); else the eager function."""
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))  # one graph per width
    gen = torch.Generator(device="cpu").manual_seed(1)
    try:
        compiled = torch.compile(quantize_activations, dynamic=False)
        for m, k in ((333, 5120), (7, 1000)):
            x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]).to(device, dtype)
            x[0] = 0
            torch._dynamo.maybe_mark_dynamic(x, 0)
            (q, s), (q_ref, s_ref) = compiled(x), quantize_activations(x)
            if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)):
                log.warning("compiled FP8 activation quantization differs from eager on %s: eager is used", device)
                return quantize_activations
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - no Triton, an inductor failure: eager gives the same values
        log.warning("FP8 activation quantization does not compile on %s (%s): eager is used", device, e)
        return quantize_activations
    return compiled


class BlockFP8Linear(nn.Module):
    """y = x W^T (+ b) with W the checkpoint's e4m3 weight x its block scales and x quantized per token and
    128-channel group, as the FP8 model runs; output in x's dtype."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int], bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.block = list(block)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale_inv", scale_inv.float().contiguous())
        # the GEMM's layout of it, made once (not a checkpoint tensor: not in the state dict)
        self.register_buffer("weight_scale_mm", padded_weight_scale(self.weight_scale_inv), persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = _quantize_input(x)
        y = self._product(xq, xs, x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    @torch.compiler.disable  # (a compiled layer around it: the GEMM and its once-per-GPU self-check run eager)
    def _product(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        fits = self.block == [128, 128] and self.in_features % 128 == 0 and self.out_features % 128 == 0
        if fits and fast_path_ok(xq.device):
            try:
                return _scaled_mm(xq, xs, self.weight, self.weight_scale_mm, dtype)
            except (RuntimeError, ValueError) as e:  # a shape the kernel declines: this call emulates
                if (xq.device, xq.shape[0]) not in _DECLINED:
                    _DECLINED.add((xq.device, xq.shape[0]))
                    log.warning("FP8 GEMM declined %s x %s on %s (%s): emulated", *xq.shape, xq.device, e)
        return emulated_matmul(xq, xs, self.weight, self.weight_scale_inv, self.block).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


def install(model: nn.Module, model_path: str, block: list[int]) -> int:
    """Replace every linear whose weight the checkpoint at `model_path` stores in FP8 by a BlockFP8Linear holding
    that stored weight and its scale (from whichever shard files hold them); returns how many. The model was
    loaded dequantized (its other tensors as they should be). A multimodal checkpoint's `model.language_model.X`
    is the text model's `model.X`; FP8 tensors outside the text model (vision tower, multi-token prediction) are
    skipped as transformers skips them; any other name that matches no linear is an error."""
    from safetensors import safe_open

    from dflash_pipeline.errors import CompatError
    from dflash_pipeline.extraction.modelfiles import safetensors_header, weight_files

    where = {k: f for f in weight_files(model_path) for k in safetensors_header(f) if k != "__metadata__"}

    def tensor(key: str) -> torch.Tensor:
        with safe_open(str(where[key]), "pt") as fh:
            return fh.get_tensor(key)

    modules = dict(model.named_modules())
    n = skipped = 0
    for key in sorted(k for k in where if k.endswith(".weight_scale_inv")):
        stored = key.removesuffix(".weight_scale_inv")
        name = next((c for c in (stored, stored.replace(".language_model.", ".", 1)) if c in modules), None)
        if name is None:
            if ".layers." in stored and not any(p in stored for p in ("visual", "vision", "mtp")):
                raise CompatError(f"{where[key]}: {key} scales {stored}, which is no module of the loaded model")
            skipped += 1
            continue
        linear = modules[name]
        if not isinstance(linear, nn.Linear):
            raise CompatError(f"{where[key]}: {key} scales {stored}, which is not a linear layer of the loaded model")
        if f"{stored}.weight" not in where:
            raise CompatError(f"{model_path}: {key} has no {stored}.weight in any weight file")
        bias = linear.bias.detach() if linear.bias is not None else None
        layer = BlockFP8Linear(tensor(f"{stored}.weight"), tensor(key), block, bias)
        layer.to(linear.weight.device)  # a split replica's layers already sit on their GPUs
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, layer)
        n += 1
    if skipped:
        log.info("%s: %d FP8 tensors outside the text model (not loaded by transformers) skipped", model_path, skipped)
    _scope_input_cache(model)
    return n


def quantize_model(model: nn.Module, block: tuple[int, int] = (128, 128)) -> int:
    """Replace every linear of the decoder layers whose shape `block` divides by a BlockFP8Linear of its weight
    quantized to the published format on its own device (what quantize_fp8_checkpoint writes, without the disk
    round trip: benchmarks of random-weight models too large to save). Returns how many."""
    n = 0
    for name, m in list(model.named_modules()):
        if ".layers." not in f".{name}." or not isinstance(m, nn.Linear):
            continue
        if m.out_features % block[0] or m.in_features % block[1]:
            continue
        wq, ws = quantize_fp8_weight(m.weight.detach(), block)
        bias = m.bias.detach() if m.bias is not None else None
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, BlockFP8Linear(wq, ws, list(block), bias))
        n += 1
    _scope_input_cache(model)
    return n
