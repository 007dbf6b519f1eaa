"""The heavy tail of the grouped schemes' quantization (storage/quant.py, int8 and int4) as one Triton kernel on a
CUDA GPU: each value divided by its group's step, rounded half to even, clamped to [-QMAX, QMAX] and, for int4,
two values packed in a byte, in one pass that reads the bf16 rows and writes the stored bytes.

Eager torch takes ~8 passes over the rows for the same work (a float32 quotient, rounding, clamping, the cast, the
nibble packing): 2.2% of the 8B forward in session 21 (bench/RESULTS.md), above issue 29's 2% budget.

The kernel divides with `div_rn` (IEEE round to nearest: Triton's `/` is an approximate division, and CUDA eager
and the CPU divide exactly) and rounds half to even, as torch.round does, so its bytes are the eager path's.
`kernel_for(device)` checks that once per device on rows that exercise every branch (massive activations, a zero
row, NaN and infinities, ties, quotients that are ties only under exact division) and returns None where Triton is
missing or the check fails (logged): the caller then keeps eager, which gives the same bytes.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)
GROUP = 32  # storage/quant.py's GROUP (not imported: quant imports this module)
BLOCK = 1024  # stored columns per program
_CHECKED: dict[torch.device, object] = {}  # device -> round_pack, or None (no Triton, or not bit-equal)

try:
    import triton
    import triton.language as tl

    if not hasattr(tl, "div_rn"):  # (Triton < 3.5) eager then
        raise ImportError("triton.language.div_rn")

    @triton.jit
    def _level(x, s, QMAX: tl.constexpr):
        y = tl.div_rn(x.to(tl.float32), s)
        y = tl.where(y != y, 0.0, y)  # NaN -> 0 (its row's reference is NaN: the row decodes to NaN anyway)
        # clamping before rounding to the integer bounds gives the same as after (+-inf -> +-QMAX, as nan_to_num
        # then clamp do); then round half to even with float32 adds: |y| <= 127 < 2^22
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: the sum keeps no fraction bits, rounded half to even
        return y.to(tl.int32)

    @triton.jit
    def _round_pack_kernel(
        x_ptr,
        step_ptr,
        out_ptr,
        hidden,
        n_cols,
        n_groups,
        QMAX: tl.constexpr,
        INT4: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x_row = x_ptr + row * hidden
        if INT4:  # stored column c holds channels 2c (low nibble) and 2c + 1, both of group 2c // 32
            s = tl.load(step_ptr + row * n_groups + cols // (GROUP // 2), mask=mask, other=1.0)
            lo = _level(tl.load(x_row + 2 * cols, mask=mask, other=0.0), s, QMAX)
            hi = _level(tl.load(x_row + 2 * cols + 1, mask=mask, other=0.0), s, QMAX)
            tl.store(out_ptr + row * n_cols + cols, ((lo & 15) | ((hi & 15) << 4)).to(tl.uint8), mask=mask)
        else:
            s = tl.load(step_ptr + row * n_groups + cols // GROUP, mask=mask, other=1.0)
            q = _level(tl.load(x_row + cols, mask=mask, other=0.0), s, QMAX)
            tl.store(out_ptr + row * n_cols + cols, q.to(tl.int8), mask=mask)

except ImportError:  # CPU-only installs: quant.py's eager path
    triton = None


def round_pack(x: torch.Tensor, step: torch.Tensor, qmax: float, int4: bool) -> torch.Tensor:
    """x [..., H] (bf16 / fp16 / fp32 on a CUDA device), step [..., ceil(H / 32)] float32 -> q: int4 [..., H / 2]
    uint8 (even channel in the low nibble), int8 [..., H] int8. Non-finite quotients as quant.py's eager path."""
    *lead, h = x.shape
    x = x.contiguous().view(-1, h)
    step = step.contiguous().view(-1, step.shape[-1])
    n_cols = h // 2 if int4 else h
    out = torch.empty(x.shape[0], n_cols, dtype=torch.uint8 if int4 else torch.int8, device=x.device)
    if x.shape[0]:
        grid = (x.shape[0], triton.cdiv(n_cols, BLOCK))
        with torch.cuda.device(x.device):
            _round_pack_kernel[grid](
                x, step, out, h, n_cols, step.shape[-1], QMAX=qmax, INT4=int4, GROUP=GROUP, BLOCK=BLOCK
            )
    return out.view(*lead, n_cols)


def kernel_for(device: torch.device, eager) -> object:
    """round_pack where Triton runs on `device` and gives eager's bytes for int8 and int4, else None. `eager(x,
    step, qmax, int4)` is quant.py's eager tail, the reference."""
    if device in _CHECKED:
        return _CHECKED[device]
    fn = None
    if triton is not None and device.type == "cuda":
        try:
            fn = round_pack if _agrees(device, eager) else None
            if fn is None:
                log.warning("the Triton store quantization differs from eager on %s: eager is used", device)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a Triton failure to compile or launch: eager gives the same bytes
            log.warning("the Triton store quantization does not run on %s (%s): eager is used", device, e)
    _CHECKED[device] = fn
    return fn


def _agrees(device: torch.device, eager) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(2)
    h = 1000  # not a multiple of GROUP nor of BLOCK: a partial group and a partial program
    x = torch.randn(70, h, generator=gen) * torch.logspace(-30, 30, 70)[:, None]
    x[1, 5] *= 3000.0  # a massive activation
    x[2] = 0.0
    x[3, 7], x[4, 9], x[5, 11] = math.nan, math.inf, -math.inf
    step = torch.rand(70, -(-h // GROUP), generator=gen) + 0.01
    step[6] = 0.25
    x[6] = (torch.arange(h) % 24 - 12) * 0.5 * 0.25  # exact ties (in bf16 too): half to even
    step[2] = 1.0
    # quotients that are ties only under exact division (a reciprocal's product misses some by an ulp)
    x[7] = (torch.arange(h) % 24 - 11.5) * step[7].repeat_interleave(GROUP)[:h]
    for dtype in (torch.bfloat16, torch.float32):
        xd, sd = x.to(device, dtype), step.to(device)
        for qmax, int4 in ((127.0, False), (7.0, True)):
            if not torch.equal(round_pack(xd, sd, qmax, int4), eager(xd, sd, qmax, int4)):
                return False
    return True
