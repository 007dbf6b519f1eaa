"""Compact hidden states: fp8 (e4m3) or int8 values with one float32 scale per token row and layer.

`extract.store_precision` (docs/STORE.md, "Compact precisions"):
- `full`: the values as computed, in the store dtype (bfloat16 on a GPU): what the store always held;
- `fp8`: each row x of H values (one token, one layer) is stored as q = e4m3fn(x / s) with s = max|x| / 448
  (448 is e4m3fn's largest finite value), q's raw bits as uint8; x = q * s;
- `int8`: q = round(x / s) clamped to [-127, 127] with s = max|x| / 127 (symmetric, no zero point); x = q * s.

The scale is float32, not bf16: it is 4 bytes per row of H bytes (0.1% of an 8B-class row, H = 4096), and a
bf16 scale would add up to 0.4% of relative error to every value of its row, as much as int8's own rounding.
float32 also decodes with plain numpy. An all-zero row gets s = 0 (and q = 0); a row with a NaN or an infinity
gets a non-finite scale, so its dequantized values are non-finite and validation reports them.

Quantization runs where the rows are, in float32: on the GPU in the extraction worker, before the copy to
host memory, so the host and the writers see half the bytes of bf16.

Error bound per row, used by validation (`error_bound`): int8 rounds to the nearest step, so every element is
off by at most s / 2 and the row by at most sqrt(H) * s / 2 (L2). fp8 e4m3 keeps 3 mantissa bits: a value in
the normal range (|x / s| >= 2^-6) is off by at most 2^-4 of itself, one in the subnormal range by at most
half the smallest step, s * 2^-10; so the row is off by at most 2^-4 * |x| + sqrt(H) * s * 2^-10 (L2).
"""

from __future__ import annotations

import math

import numpy as np
import torch

PRECISIONS = ("full", "fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
# The Zarr data type of the quantized values: fp8 as its raw bits (numpy has no float8), int8 as is.
STORED = {"fp8": np.dtype("uint8"), "int8": np.dtype("int8")}
STORED_TORCH = {"fp8": torch.uint8, "int8": torch.int8}
SCALE_DTYPE = np.dtype("float32")
# Arrays holding each captured array's per-row scales (same token axis and shards as the data).
SCALE_OF = {"hidden": "hidden_scale", "last_hidden": "last_hidden_scale"}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"store precision {precision!r} is not one of {PRECISIONS}")
    return precision


def quantize(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., H] (any float dtype, any device) -> (q [..., H] in STORED[precision] as a torch dtype of the
    same size: uint8 bits of e4m3fn, or int8; scale [...] float32), on x's device."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = amax / QMAX[precision]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)).unsqueeze(-1)
    y = xf * inv
    if precision == "fp8":
        q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = y.round().clamp(-127.0, 127.0).to(torch.int8)
    bad = ~torch.isfinite(amax)  # keep NaN / inf visible: the row dequantizes to non-finite values
    if bad.any():
        scale = torch.where(bad, torch.full_like(scale, math.nan), scale)
    return q, scale


def dequantize(q, scale, precision: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored q [..., H] (numpy or torch, STORED dtype) and scale [...] -> values [..., H] in `dtype`.

    numpy arrays (what the reader gets from zarr) are decoded on the CPU through a 256-entry table and scaled in
    place: two passes over float32, about 1.7x faster here than torch's own float8 conversion on the CPU;
    tensors (e.g. on a GPU) through torch."""
    if isinstance(q, np.ndarray):
        vals = _E4M3[q] if precision == "fp8" else q.astype(np.float32)
        vals *= np.asarray(scale, dtype=np.float32)[..., None]
        return torch.from_numpy(vals).to(dtype)
    vals = q.view(torch.float8_e4m3fn).float() if precision == "fp8" else q.float()
    return (vals * scale.float().unsqueeze(-1)).to(dtype)


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


def error_bound(precision: str, scale: torch.Tensor, values: torch.Tensor) -> float:
    """Largest L2 norm the quantization error of these rows can have (see the module doc): `scale` [N] the
    rows' stored scales, `values` [N, H] the true (or recomputed) rows."""
    h = values.shape[-1]
    s = scale.double()
    if precision == "int8":
        return math.sqrt(h) * float((s / 2).pow(2).sum().sqrt())
    if precision == "fp8":
        return 2.0**-4 * float(values.double().norm()) + math.sqrt(h) * float((s * 2.0**-10).pow(2).sum().sqrt())
    return 0.0
