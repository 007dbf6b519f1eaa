"""The grouped schemes' quantization (storage/quant.py, int8 and int4) as one Triton kernel on a CUDA GPU: one
program per row reads the row once and writes its stored values and scale bytes (group maxima, the row reference
R, each group's code and step, the division, rounding, clamping and, for int4, two values a byte).

Eager torch takes ~12 kernels and one host synchronisation per batch for the same work (the non-finite check).
Measured on an H200 (bench/RESULTS.md, Compact stores, 2026-12-05): eager int4 9.4 ms per 16,384-token batch of the
8B shape, 2.2% of the forward (issue 29's budget: 2%); a kernel for the division-to-packing tail alone 4.7 ms, the
rest being the steps' small kernels and the synchronisation, which also leaves the GPU idle between batches.

Its bytes are the eager path's: divisions with `div_rn` (IEEE round to nearest: Triton's `/` is approximate, and
CUDA eager and the CPU divide exactly), rounding half to even with float32 adds (as torch.round), each group's code
found from an estimate (-16 log2 of its share of the row's max) corrected against the same float32 table of steps
(quant.STEPS) that eager's searchsorted reads, and a non-finite row stored as eager stores it (R = NaN, codes 0,
values 0). `kernel_for(device, dtype, hidden)` checks that once per kernel variant against the eager path on rows
that exercise every branch (`probe_rows`), and returns None where Triton is missing (or older than 3.6) or the
check fails (logged): the caller then keeps eager.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

log = logging.getLogger(__name__)
# (device, dtype, hidden) -> quantize, or None (no Triton, or not bit-equal to eager for that kernel variant)
_CHECKED: dict[tuple[torch.device, torch.dtype, int], object] = {}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernel reads (float64 divides in float64 eagerly)

try:
    import triton
    import triton.language as tl

    # Triton 3.5 compiles div_rn to div.rn.ftz: subnormal steps flush to zero (Triton PR 8557); older ones lack it
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        raise ImportError(f"Triton {triton.__version__} (the store quantization kernel needs 3.6 or newer)")

    @triton.jit
    def _level(x, step, QMAX: tl.constexpr):
        """round(x / step) clamped to [-QMAX, QMAX], int32; NaN -> 0, +-inf -> +-QMAX (as eager's nan_to_num)."""
        y = tl.div_rn(x, step)
        y = tl.where(y != y, 0.0, y)
        # clamping to the integer bounds before rounding gives what clamping after does; then round half to even
        # with float32 adds: |y| <= 127 < 2^22, and 1.5 * 2^23 leaves the sum no fraction bits
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        y = (y + 12582912.0) - 12582912.0
        return y.to(tl.int32)

    @triton.jit
    def _nonfinite(v):
        return tl.max(tl.max(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=1), axis=0)

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        steps_ptr,
        q_ptr,
        scale_ptr,
        hidden,
        n_groups,
        n_cols,
        QMAX: tl.constexpr,
        INT4: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        NAN_BITS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, G_PAD)
        x_row = x_ptr + row * hidden
        # the row as [groups, channels]; int4 as its even and its odd channels (one byte holds one of each)
        if INT4:
            j = tl.arange(0, GROUP // 2)[None, :]
            ch = g[:, None] * GROUP + 2 * j
            m = ch < hidden  # (hidden is even: the odd channel is in the row where the even one is)
            a = tl.load(x_row + ch, mask=m, other=0.0).to(tl.float32)
            b = tl.load(x_row + ch + 1, mask=m, other=0.0).to(tl.float32)
            gmax = tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1))
            bad = tl.maximum(_nonfinite(a), _nonfinite(b))
        else:
            j = tl.arange(0, GROUP)[None, :]
            ch = g[:, None] * GROUP + j
            m = ch < hidden
            a = tl.load(x_row + ch, mask=m, other=0.0).to(tl.float32)
            gmax = tl.max(tl.abs(a), axis=1)
            bad = _nonfinite(a)
        amax = tl.max(gmax, axis=0)
        ratio = tl.where(amax > 0, tl.div_rn(gmax, tl.where(amax > 0, amax, 1.0)), 0.0)
        # code: the largest c with STEPS[c] >= ratio (eager: 255 - searchsorted(increasing steps, ratio)), from
        # -16 log2(ratio) (ratio 0: inf -> 255), clamped as an integer (a non-finite row's NaN: any index in range)
        est = tl.minimum(tl.maximum(-16.0 * tl.log2(ratio), 0.0), 255.0)
        c = tl.minimum(tl.maximum(est.to(tl.int32), 0), 255)
        for _ in tl.static_range(2):  # the estimate is off by at most one step either way
            up = tl.load(steps_ptr + tl.minimum(c + 1, 255))
            c = tl.where((c < 255) & (up >= ratio), c + 1, c)
        for _ in tl.static_range(2):
            c = tl.where((c > 0) & (tl.load(steps_ptr + c) < ratio), c - 1, c)
        ref = tl.div_rn(amax, QMAX)
        step = ref * tl.load(steps_ptr + c)
        step = tl.where(step == 0, 1.0, step)[:, None]
        if INT4:
            out = (_level(a, step, QMAX) & 15) | ((_level(b, step, QMAX) & 15) << 4)
            out = tl.where(bad != 0, 0, out)
            tl.store(q_ptr + row * n_cols + g[:, None] * (GROUP // 2) + j, out.to(tl.uint8), mask=m)
        else:
            out = tl.where(bad != 0, 0, _level(a, step, QMAX))
            tl.store(q_ptr + row * n_cols + ch, out.to(tl.int8), mask=m)
        scale_row = scale_ptr + row * (4 + n_groups)
        bits = tl.where(bad != 0, NAN_BITS, ref.to(tl.uint32, bitcast=True)).to(tl.uint32)
        k = tl.arange(0, 4).to(tl.uint32)
        tl.store(scale_row + k, ((bits >> (8 * k)) & 255).to(tl.uint8))  # R's float32 bytes, little-endian
        tl.store(scale_row + 4 + g, tl.where(bad != 0, 0, c).to(tl.uint8), mask=g < n_groups)

except Exception as e:  # noqa: BLE001 - no Triton (CPU-only installs), an old or broken one: quant.py's eager path
    log.debug("no Triton store quantization: %s", e)
    triton = None


def quantize(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quant.quantize of a grouped precision, x [..., H] (bf16 / fp16 / fp32) on a CUDA device, in one kernel."""
    from dflash_pipeline.storage import quant

    *lead, h = x.shape
    n_groups = quant.groups(h, precision)
    int4 = precision == "int4"
    n_cols = h // 2 if int4 else h
    rows = x.contiguous().view(-1, h)
    q = torch.empty(rows.shape[0], n_cols, dtype=quant.STORED_TORCH[precision], device=x.device)
    scale = torch.empty(rows.shape[0], quant.SCALE_HEADER + n_groups, dtype=torch.uint8, device=x.device)
    if rows.shape[0]:
        g_pad = triton.next_power_of_2(n_groups)
        # (on the CPU only in Triton's interpreter, TRITON_INTERPRET=1: tests/unit/test_quant_kernel.py)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _quantize_kernel[(rows.shape[0],)](
                rows, quant._steps(x.device)[0], q, scale, h, n_groups, n_cols,
                QMAX=quant.QMAX[precision], INT4=int4, GROUP=quant.GROUP, G_PAD=g_pad, NAN_BITS=0x7FC00000,
                num_warps=8 if g_pad * quant.GROUP >= 4096 else 4,
            )  # fmt: skip
    return q.view(*lead, n_cols), scale.view(*lead, scale.shape[-1])


def kernel_for(device: torch.device, dtype: torch.dtype, hidden: int):
    """`quantize` where Triton runs on `device` and gives the eager path's bytes for rows of `hidden` channels in
    `dtype`, else None (logged). Checked once per (device, dtype, hidden): each is its own compiled variant of the
    kernel (tile size, warps, alignment), so the check runs the variant the rows will."""
    key = (device, dtype, hidden)
    if key in _CHECKED:
        return _CHECKED[key]
    fn = None
    if triton is not None and device.type == "cuda" and dtype in DTYPES:
        try:
            fn = quantize if _agrees(device, dtype, hidden) else None
            if fn is None:
                log.warning("the Triton store quantization differs from eager on %s (%s, %d channels): eager is used",
                            device, dtype, hidden)  # fmt: skip
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a Triton failure to compile or launch: eager gives the same bytes
            log.warning("the Triton store quantization does not run on %s (%s): eager is used", device, e)
    _CHECKED[key] = fn
    return fn


def probe_rows(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of `hidden` channels that exercise every branch of the grouped quantization: 60 decades of magnitude, a
    massive activation, a zero row, a zero group, NaN and infinities, exact ties, quotients that are ties only
    under exact division, group maxima at the codes' boundaries, a subnormal row reference R (and in float32
    subnormal values: Triton's interpreter converts bf16 subnormals wrongly, the GPU does not)."""
    from dflash_pipeline.storage import quant

    gen = torch.Generator(device="cpu").manual_seed(2)
    h = hidden
    x = torch.randn(72, h, generator=gen) * torch.logspace(-30, 30, 72)[:, None]
    x[1, min(5, h - 1)] *= 3000.0
    x[2] = 0.0
    x[3, min(7, h - 1)], x[4, min(9, h - 1)], x[5, h // 2] = math.nan, math.inf, -math.inf
    x[6] = (torch.arange(h) % 24 - 12) * 0.5 * 0.25  # ties (exact in bf16 too): half to even
    x[6, 0] = 3.0  # R = 3 / QMAX: the steps are not powers of two
    x[8, :64] = 0.0
    # groups whose share of the row's max (1) is a step of the table exactly, or one float32 ulp above it: the
    # codes' boundaries, where a log2 estimate is off by one
    steps, cols = torch.from_numpy(quant.STEPS), torch.arange(1, min(quant.groups(h, "int8"), 32))
    for r, nudge in ((10, 0), (11, 1)):
        x[r] = 0.0
        x[r, 0] = 1.0
        shares = steps[(cols * 8 + r) % 256]
        x[r, cols * 32] = shares if not nudge else torch.nextafter(shares, torch.tensor(2.0))
    for r, qmax in ((7, 127.0), (9, 7.0)):  # every group's max is the row's, so every step is R = 12 / qmax
        k = torch.arange(h) % int(2 * qmax) - qmax
        x[r] = (k + 0.5) * (torch.tensor(12.0) / qmax)  # quotients that are ties only under exact division
        x[r, ::32] = 12.0
    # normal values (1e-37 to 2e-37) whose R = max / QMAX falls below float32's normal range
    x[12] = (1 + torch.rand(h, generator=gen)) * 1e-37 * torch.where(torch.arange(h) % 3 == 0, -1.0, 1.0)
    if dtype == torch.float32:
        x[13] = torch.randn(h, generator=gen) * 1e-40  # subnormal values and maxima
    return x.to(dtype)


def _agrees(device: torch.device, dtype: torch.dtype, hidden: int) -> bool:
    from dflash_pipeline.storage import quant

    x = probe_rows(hidden, dtype).to(device)
    for precision in quant.GROUPED if hidden % 2 == 0 else ("int8",):
        q, s = quantize(x, precision)
        q_ref, s_ref = quant._quantize_grouped_eager(x, precision)
        if not (torch.equal(q, q_ref) and torch.equal(s, s_ref)):
            return False
    return True
