"""Compact hidden states: fp8 (e4m3) values with one float32 scale per token row and layer, or int8 / int4
values with a step per group of 32 channels.

`extract.store_precision` (docs/STORE.md, "Compact precisions"):
- `full`: the values as computed, in the store dtype (bfloat16 on a GPU): what the store always held;
- `fp8`: each row x of H values (one token, one layer) is stored as q = e4m3fn(x / s) with s = max|x| / 448
  (448 is e4m3fn's largest finite value), q's raw bits as uint8; x = q * s;
- `int8` and `int4`: the row in groups of GROUP = 32 channels, each group g with its own step s_g: q = round(x /
  s_g) in [-QMAX, QMAX] (127, 7; int4 two values a byte, even channel in the low nibble, 4-bit two's complement).
  The steps are two-level: a float32 row reference R = max|x| / QMAX and one byte c_g per group, s_g = R *
  2^(-c_g / 16) (c_g the largest code whose step still reaches the group's max|x| / QMAX: no value is clipped).
  So the group holding the row's largest value (a massive activation) has s_g = R exactly and keeps that value to
  float32 rounding, and the other groups' steps are within 2^(1/16) (4.4%) of their own max / QMAX down to 2^-16 of
  the row's max. The scale array holds per row the 4 bytes of R (little-endian float32) and then the codes:
  [..., 4 + ceil(H / 32)] uint8. int4: 0.266 of raw bf16 at H = 4096 or 5120 (0.5 + 1/32 byte a value, 4 bytes a
  row); int8: 0.516.
- `int8-row` (INT8_ROW): the int8 of versions written before int8 took group steps (no root attribute
  `int8_scales`): q = round(x / s) clamped to [-127, 127], s = max|x| / 127 one float32 per row. Read, validated
  and never written for a new version: one step per row makes a massive activation's row lose every other channel
  (tests/unit/test_quant.py). `scheme(attrs)` says which of these a version holds.

The fp8 scale is float32, not bf16: it is 4 bytes per row of H bytes (0.1% of an 8B-class row, H = 4096), and a
bf16 scale would add up to 0.4% of relative error to every value of its row. float32 also decodes with plain numpy.
An all-zero row gets s = 0 (and q = 0); a row with a NaN or an infinity gets a non-finite scale (grouped: R = NaN),
so its dequantized values are non-finite and validation reports them.

Quantization runs where the rows are, in float32: on the GPU in the extraction worker, before the copy to
host memory, so the host and the writers see about half the bytes of bf16 (a quarter with int4).

Error bound per row, used by validation (`error_bound`): int8 / int4 round to the nearest step, so every element
is off by at most s_g / 2 and the row by at most sqrt(sum_g n_g * s_g^2) / 2 (L2; n_g the group's channels; one
group of H for int8-row). fp8 e4m3 keeps 3 mantissa bits: a value in the normal range (|x / s| >= 2^-6) is off by
at most 2^-4 of itself, one in the subnormal range by at most half the smallest step, s * 2^-10; so the row is off
by at most 2^-4 * |x| + sqrt(H) * s * 2^-10 (L2).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import quant_gpu

PRECISIONS = ("full", "fp8", "int8", "int4")  # what extract.store_precision takes
INT8_ROW = "int8-row"  # the scheme of int8 versions written before int8 took group steps (read, never written)
QMAX = {"fp8": 448.0, INT8_ROW: 127.0, "int8": 127.0, "int4": 7.0}
GROUPED = ("int8", "int4")  # the schemes with a step per group of GROUP channels (scale bytes: R + codes)
# The Zarr data type of the quantized values: fp8 as its raw bits (numpy has no float8), int8 as is, int4 two
# values a byte.
STORED = {"fp8": np.dtype("uint8"), INT8_ROW: np.dtype("int8"), "int8": np.dtype("int8"), "int4": np.dtype("uint8")}
STORED_TORCH = {"fp8": torch.uint8, INT8_ROW: torch.int8, "int8": torch.int8, "int4": torch.uint8}
SCALE_DTYPE = np.dtype("float32")  # fp8 / int8-row; the grouped schemes' scale array is uint8 (SCALE_HEADER + codes)
# Arrays holding each captured array's scales (same token axis and shards as the data).
SCALE_OF = {"hidden": "hidden_scale", "last_hidden": "last_hidden_scale"}
# The root attribute that marks an int8 version's group steps (versions without it hold INT8_ROW)
INT8_SCALES_ATTR, INT8_SCALES = "int8_scales", "group32"

GROUP = 32  # channels sharing one step
SCALE_HEADER = 4  # bytes of the row reference R (float32, little-endian) before the group codes
# Step of group code c relative to the row reference: float32(2^(-c / 16)), c = 0..255 (decreasing).
STEPS = (2.0 ** (-np.arange(256) / 16)).astype(np.float32)
assert sys.byteorder == "little", "the row reference of the grouped schemes is stored as the host's float32 bytes"


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(
            f"store precision {precision!r} is not one of {PRECISIONS}: set extract.store_precision to one of them"
        )
    return precision


def precision_attrs(precision: str) -> dict[str, str]:
    """The root attributes that say which scheme a new version of `precision` holds."""
    return {"precision": precision, **({INT8_SCALES_ATTR: INT8_SCALES} if precision == "int8" else {})}


def scheme(attrs: dict) -> str:
    """The scheme a version's values are stored in, from its root attributes: its `precision` (absent: full), and
    for int8 INT8_ROW unless `int8_scales` says group steps."""
    precision = attrs.get("precision", "full")
    if precision != "int8":
        return precision
    marked = attrs.get(INT8_SCALES_ATTR)
    if marked is None:
        return INT8_ROW
    if marked != INT8_SCALES:
        raise StoreError(
            f"root attribute {INT8_SCALES_ATTR}={marked!r} is not {INT8_SCALES!r}, the only int8 layout: the version's "
            "zarr.json was edited or damaged; `dflash-pipeline verify` says what else differs from its records"
        )
    return "int8"


def groups(hidden: int, precision: str) -> int:
    """Groups of a grouped row of `hidden` channels (the last one partial when GROUP does not divide it)."""
    if precision == "int4" and hidden % 2:
        raise ValueError(
            f"store precision 'int4' packs two values a byte and needs an even hidden size, the target's is "
            f"{hidden}: set extract.store_precision to fp8 or int8"
        )
    return -(-hidden // GROUP)


def row_shapes(precision: str, logical: np.dtype, k: int, hidden: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Per-token shape and Zarr dtype of each sharded array (docs/STORE.md): `hidden` [K, H'], `last_hidden` [H'],
    and in a compact scheme `hidden_scale` [K, ...] and `last_hidden_scale` [...]. `logical` is the stored dtype
    of precision 'full'."""
    if precision == "full":
        return {"hidden": ((k, hidden), logical), "last_hidden": ((hidden,), logical)}
    if precision in GROUPED:
        cols = (hidden // 2,) if precision == "int4" else (hidden,)
        scale, sdtype = (SCALE_HEADER + groups(hidden, precision),), np.dtype("uint8")
    else:
        cols, scale, sdtype = (hidden,), (), SCALE_DTYPE
    dtype = STORED[precision]
    return {
        "hidden": ((k, *cols), dtype),
        "last_hidden": (cols, dtype),
        "hidden_scale": ((k, *scale), sdtype),
        "last_hidden_scale": (scale, sdtype),
    }


def row_bytes(precision: str, hidden: int, logical_itemsize: int = 2) -> int:
    """Uncompressed bytes of one stored row (one token of one layer: H values) and its scale."""
    if precision == "full":
        return hidden * logical_itemsize
    values = hidden // 2 if precision == "int4" else hidden
    if precision in GROUPED:
        return values + SCALE_HEADER + groups(hidden, precision)
    return values + SCALE_DTYPE.itemsize


def quantize(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., H] (any float dtype, any device) -> (q, scale) on x's device: fp8 / int8-row: q [..., H]
    (uint8 bits of e4m3fn, or int8), scale [...] float32; int8: q [..., H] int8, int4: q [..., H/2] uint8, both
    with scale [..., 4 + ceil(H/32)] uint8."""
    if precision in GROUPED:
        return _quantize_grouped(x, precision)
    amax = _absmax(x)
    scale = _over_qmax(amax, precision)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)).unsqueeze(-1)
    y = x * inv  # widened to float32 on the fly: no float32 copy of the rows
    if precision == "fp8":
        q = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = y.round_().clamp_(-127.0, 127.0).to(torch.int8)
    # keep NaN / inf visible: the row dequantizes to non-finite values (no `if bad.any()`: a host sync per batch
    # would leave the GPU idle while the extraction loop waits on it)
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, math.nan))
    return q, scale


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the last axis, float32: one aminmax pass over x as it is (a max is exact in any dtype, and no
    |x| or float32 copy of the rows is made); NaN propagates (documented), so a NaN row is still seen; abs: an
    all-zero row gives +0, not -0."""
    lo, hi = torch.aminmax(x, dim=-1)
    return torch.maximum(hi, -lo).float().abs_()


_QMAX_ON: dict[tuple[torch.device, str], torch.Tensor] = {}


def _over_qmax(amax: torch.Tensor, precision: str) -> torch.Tensor:
    """amax / QMAX[precision], correctly rounded on every device: CUDA computes `tensor / python_number` as a
    product with the number's float32 reciprocal (one ulp off at times), so a store quantized on a GPU had other
    scale bits than the same rows quantized on the CPU; dividing by a tensor on amax's device is a true division."""
    key = (amax.device, precision)
    if key not in _QMAX_ON:
        _QMAX_ON[key] = torch.tensor(QMAX[precision], dtype=torch.float32, device=amax.device)
    return amax / _QMAX_ON[key]


_STEPS_ON: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _steps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(STEPS, the same increasing) as tensors on `device`."""
    if device not in _STEPS_ON:
        t = torch.from_numpy(STEPS).to(device)
        _STEPS_ON[device] = (t, t.flip(0).contiguous())
    return _STEPS_ON[device]


def _quantize_grouped(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """On a CUDA GPU one Triton kernel (storage/quant_gpu.py: the quantization runs inside the extraction worker's
    budget, issue 29: <= 2% of the forward), checked there to give the eager path's bytes; elsewhere eager."""
    fused = quant_gpu.kernel_for(x.device, x.dtype, x.shape[-1]) if x.is_cuda else None
    return (fused or _quantize_grouped_eager)(x, precision)


def prepare(device: torch.device, dtype: torch.dtype, hidden: int, precision: str) -> None:
    """The GPU kernel of a grouped precision compiled and checked ahead of the first rows of `hidden` channels in
    `dtype` (a second or so; more with a cold Triton cache): the extraction worker does it while the model loads,
    so that its first batch does not wait for it. `device` with its index (cuda:N)."""
    if precision in GROUPED and device.type == "cuda":
        quant_gpu.kernel_for(device, dtype, hidden)


def _quantize_grouped_eager(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped quantization in torch (the reference of storage/quant_gpu.py's kernel): the group maxima in one
    pass over x as it is (a max is exact in any dtype), one division computed in float32 from x's own values (no
    float32 copy of the rows), rounding into int8 and, for int4, the packing in bytes."""
    qmax = QMAX[precision]
    *lead, h = x.shape
    n_groups = groups(h, precision)
    if n_groups * GROUP != h:  # zeros complete the last group: they change no group's max
        x = torch.nn.functional.pad(x, (0, n_groups * GROUP - h))
    xg = x.view(*lead, n_groups, GROUP)
    gmax = _absmax(xg)  # [..., groups]
    amax = gmax.amax(-1)
    bad = ~torch.isfinite(amax)  # NaN / inf: R = NaN, so the whole row decodes to NaN
    any_bad = bool(bad.any())  # the one host sync
    steps, increasing = _steps(x.device)
    ratio = torch.where(amax.unsqueeze(-1) > 0, gmax / amax.unsqueeze(-1), torch.zeros_like(gmax))
    # the largest code whose step is at least the group's share of the row's max: 255 - #(steps < ratio)
    codes = (255 - torch.searchsorted(increasing, ratio.contiguous())).clamp_(0, 255)
    ref = _over_qmax(amax, precision)
    step = ref.unsqueeze(-1) * steps[codes]
    step = torch.where(step == 0, torch.ones_like(step), step)  # an all-zero row: 0 / 1 = 0 (groups, not values)
    y = xg / step.unsqueeze(-1)  # bf16 / float32: each value widened exactly, divided in float32
    del x, xg
    if any_bad:  # only then can y hold NaN or an infinity (0 / 0, x / inf)
        y.nan_to_num_(0.0, qmax, -qmax)
    # A group's step is at least its max / qmax up to float32 rounding, so |round(y)| <= qmax, except where R is
    # a float32 subnormal (a row's max under ~1e-38 loses the precision that needs): the clamp keeps those from
    # wrapping to -128 (int4: -8), the bound documented for all
    q = y.round_().clamp_(-qmax, qmax).to(torch.int8).view(*lead, n_groups * GROUP)[..., :h]
    if precision == "int4":
        q = q.view(torch.uint8)
        q = (q[..., 0::2] & 15) | (q[..., 1::2] << 4)  # 4-bit two's complement, even channel low
    else:
        q = q.contiguous()
    if any_bad:
        ref = torch.where(bad, torch.full_like(ref, math.nan), ref)
        codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
    header = ref.contiguous().unsqueeze(-1).view(torch.uint8)  # [..., 4]: R's float32 bytes
    return q, torch.cat([header, codes.to(torch.uint8)], -1)


def dequantize(q, scale, precision: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored q and scale (numpy or torch, as `quantize` returns them) -> values [..., H] in `dtype`.

    numpy arrays (what the reader gets from zarr) are decoded on the CPU: fp8 through a 256-entry table and
    scaled in place (two passes over float32, about 1.7x faster here than torch's own float8 conversion on the
    CPU); tensors (e.g. on a GPU) through torch. Both give the same bits."""
    if precision in GROUPED:
        return _dequantize_grouped(q, scale, precision).to(dtype)
    if isinstance(q, np.ndarray):
        vals = _E4M3[q] if precision == "fp8" else q.astype(np.float32)
        vals *= np.asarray(scale, dtype=np.float32)[..., None]
        return torch.from_numpy(vals).to(dtype)
    vals = q.view(torch.float8_e4m3fn).float() if precision == "fp8" else q.float()
    return (vals * scale.float().unsqueeze(-1)).to(dtype)


def group_steps(scale) -> np.ndarray | torch.Tensor:
    """The groups' steps [..., groups] (float32) of grouped scale bytes [..., 4 + groups]: R * 2^(-c / 16)."""
    if isinstance(scale, np.ndarray):
        ref = np.ascontiguousarray(scale[..., :SCALE_HEADER]).view("<f4")
        return ref * STEPS[scale[..., SCALE_HEADER:]]
    # (a copy: R's 4 bytes of a row slice need not sit at a float32-aligned storage offset)
    ref = scale[..., :SCALE_HEADER].reshape(-1, SCALE_HEADER).clone().view(torch.float32).view(*scale.shape[:-1], 1)
    return ref * _steps(scale.device)[0][scale[..., SCALE_HEADER:].long()]


def _dequantize_grouped(q, scale, precision: str) -> torch.Tensor:
    h = 2 * q.shape[-1] if precision == "int4" else q.shape[-1]
    assert scale.shape[-1] == SCALE_HEADER + groups(h, precision), (q.shape, scale.shape)
    step = group_steps(scale)
    if isinstance(q, np.ndarray):  # the numpy decoders of docs/STORE.md
        if precision == "int4":
            b = q.astype(np.int16)
            lo, hi = ((b & 15) ^ 8) - 8, ((b >> 4) ^ 8) - 8  # 4-bit two's complement
            vals = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], h).astype(np.float32)
        else:
            vals = q.astype(np.float32)
        vals *= np.repeat(step, GROUP, axis=-1)[..., :h]
        return torch.from_numpy(vals)
    if precision == "int4":
        b = q.to(torch.int16)
        vals = torch.stack([((b & 15) ^ 8) - 8, ((b >> 4) ^ 8) - 8], -1).view(*q.shape[:-1], h).float()
    else:
        vals = q.float()
    return vals * step.repeat_interleave(GROUP, -1)[..., :h]


def e4m3fn_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bit patterns, with numpy only (what docs/STORE.md spells out):
    sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; exponent 0 is subnormal (m / 8 * 2^-6);
    0x7f and 0xff are NaN; there is no infinity."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    val = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))
    val = np.where((b & 0x7F) == 0x7F, np.nan, sign * val)
    return val.astype(np.float32)


_E4M3 = e4m3fn_table()


def error_bound(precision: str, scale, values: torch.Tensor) -> float:
    """Largest L2 norm the quantization error of these rows can have (see the module doc): `scale` the rows'
    stored scales ([N] float32; grouped: [N, 4 + groups] uint8), `values` [N, H] the true (or recomputed) rows."""
    h = values.shape[-1]
    if precision in GROUPED:
        step = torch.as_tensor(group_steps(scale)).double().cpu()
        n = torch.full((step.shape[-1],), float(GROUP), dtype=torch.float64)
        n[-1] = h - GROUP * (step.shape[-1] - 1)  # the last group may be partial
        return float((n * (step / 2).pow(2)).sum().sqrt())
    s = torch.as_tensor(scale).double()
    if precision == INT8_ROW:
        return math.sqrt(h) * float((s / 2).pow(2).sum().sqrt())
    if precision == "fp8":
        return 2.0**-4 * float(values.double().norm()) + math.sqrt(h) * float((s * 2.0**-10).pow(2).sum().sqrt())
    return 0.0
