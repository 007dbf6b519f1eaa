"""Compact precisions without a store (storage/quant.py): every precision's round trip within its documented bound,
on ordinary rows and on rows with massive activations (errors reported on the massive channels and on the rest),
the numpy and torch decoders bit for bit, docs/STORE.md's numpy-only int4 decoder against the reader's, the int4
format's edge cases (zero, non-finite, partial groups) and its bytes per token on the 8B and 27B shapes."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.storage import quant
from dflash_pipeline.storage.layout import from_storage, to_storage

ROOT = Path(__file__).resolve().parents[2]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
H = 4096
MASSIVE = {7: 1000.0, 1900: 300.0}  # the massive channels of the massive rows: times the median |x|


def doc_python(marker: str) -> str:
    """The python block of docs/STORE.md that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "STORE.md").read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def doc_decode_int4():
    space: dict = {}
    exec(doc_python("def decode_int4"), space)  # the documented snippet, as a reader copies it
    return space["decode_int4"]


def rows(n: int = 256, h: int = H, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [n, h] float32, massive [n] bool): Gaussian rows with log-normal channel scales (sigma 0.5, the
    planner's synthetic statistics); every 8th row has channels MASSIVE (modulo h) at +-1000 and +-300 times the
    median |x| (a trained LLM's massive activations: a few channels, on a few tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * torch.exp(0.5 * torch.randn(h, generator=g))
    massive = torch.arange(n) % 8 == 0
    median = x.abs().median()
    for c, factor in MASSIVE.items():
        sign = torch.where(torch.rand(int(massive.sum()), generator=g) < 0.5, -1.0, 1.0)
        x[massive, c % h] = factor * median * sign
    return x, massive


def round_trip(x: torch.Tensor, precision: str, device: str) -> tuple[torch.Tensor, object]:
    """x as stored and read back (float32, on the CPU), and the stored scales (None for full: bf16 as stored)."""
    if precision == "full":
        return from_storage(to_storage(x.to(torch.bfloat16), "bfloat16"), "bfloat16").float(), None
    q, s = quant.quantize(x.to(device), precision)
    return quant.dequantize(q.cpu().numpy(), s.cpu().numpy(), precision), s.cpu()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


# relative L2 bounds of the round trip (measured on these rows; printed with -s): ordinary rows, and on massive
# rows the massive channels and the rest
EXPECTED = {  # precision: (ordinary rows, massive channels, the rest of massive rows)
    "full": (2.0**-8, 2.0**-8, 2.0**-8),
    "fp8": (0.04, 0.04, 0.05),
    "int8": (0.01, 0.002, 0.1),
    "int4": (0.15, 0.03, 0.19),
    quant.INT8_ROW: (0.02, 0.004, None),  # the rest of a massive row: see test_one_step_per_row_loses_...
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", list(EXPECTED))
def test_round_trip_within_the_bound_with_massive_activations(precision, device):
    x, massive = rows()
    back, scale = round_trip(x, precision, device)
    if scale is not None:  # each row within quant.error_bound, the bound validation allows
        for i in range(len(x)):
            bound = quant.error_bound(precision, scale[i : i + 1], x[i : i + 1])
            assert float((back[i] - x[i]).double().norm()) <= bound * (1 + 1e-5) + 1e-6, (i, bound)
    cols = torch.zeros(x.shape[1], dtype=torch.bool)
    cols[list(MASSIVE)] = True  # (h = H here)
    ordinary = rel(back[~massive], x[~massive])
    on_massive = rel(back[massive][:, cols], x[massive][:, cols])
    rest = rel(back[massive][:, ~cols], x[massive][:, ~cols])
    whole = rel(back[massive], x[massive])
    print(
        f"\n{precision} on {device}: relative L2 ordinary rows {ordinary:.4g}; massive rows {whole:.4g} "
        f"(massive channels {on_massive:.3g}, the rest {rest:.4g})"
    )
    want = EXPECTED[precision]
    assert ordinary <= want[0] and on_massive <= want[1]
    if precision != "full":  # the row's largest value (the 1000x channel) comes back to float32 rounding
        assert rel(back[massive][:, 7], x[massive][:, 7]) < 1e-6
    if want[2] is not None:
        assert rest <= want[2]


def test_one_step_per_row_loses_the_rest_of_a_massive_row():
    """One scale per row (int8-row, the int8 of older versions): a channel 1000x the median makes the step larger
    than most other values of its row, so they round to 0 (the measured error, printed with -s). fp8 keeps them (3
    mantissa bits at any scale); int8 and int4 (a step per group of 32 channels) lose only the massive channels'
    own groups. int8's steps are never coarser than int8-row's, so it is at least as close on every value."""
    x, massive = rows()
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[list(MASSIVE)] = False  # (h = H here)
    errs, back = {}, {}
    for p in ("fp8", quant.INT8_ROW, "int8", "int4"):
        back[p], _ = round_trip(x, p, "cpu")
        errs[p] = rel(back[p][massive][:, keep], x[massive][:, keep])
    print(f"\nthe rest of massive rows, relative L2: {errs}")
    assert errs[quant.INT8_ROW] > 0.5 > 0.2 > errs["int4"] > 0.1 > errs["int8"] > errs["fp8"]
    _, row_step = quant.quantize(x, quant.INT8_ROW)
    _, grouped = quant.quantize(x, "int8")
    assert (quant.group_steps(grouped) <= row_step.unsqueeze(-1) * (1 + 1e-6)).all()
    assert ((back["int8"] - x).abs() <= row_step.unsqueeze(-1) / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp8", quant.INT8_ROW, "int8", "int4"])
def test_numpy_and_torch_decoders_agree_bit_for_bit(precision, device):
    """The reader decodes with numpy on the CPU, training with torch on its device: the same bits."""
    x, _ = rows(64, 200)  # 200: int4's last group holds 8 channels
    q, s = quant.quantize(x.to(device).view(8, 8, 200), precision)
    on_device = quant.dequantize(q, s, precision, torch.bfloat16).cpu()
    reader = quant.dequantize(q.cpu().numpy(), s.cpu().numpy(), precision, torch.bfloat16)
    assert torch.equal(on_device.view(torch.int16), reader.view(torch.int16))
    if precision == "int4":
        assert q.shape == (8, 8, 100) and s.shape == (8, 8, 4 + 7) and q.dtype == s.dtype == torch.uint8
        documented = doc_decode_int4()(q.cpu().numpy(), s.cpu().numpy())
        assert documented.dtype == np.float32
        np.testing.assert_array_equal(documented, quant.dequantize(q.cpu().numpy(), s.cpu().numpy(), "int4").numpy())


def test_int4_format_as_documented():
    """docs/STORE.md, "int4": nibble order, two's complement, R's bytes, the group codes and their steps."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 33] = 7.0, -1.0, 3.0, 0.5  # group 0: max 7 (R = 1), group 1: max 0.5
    q, s = quant.quantize(x, "int4")
    assert q[0, 0] == 0xF7 and q[0, 1] == 0x03  # channel 0 (7) low, channel 1 (-1 = 0xF) high; channel 2 (3)
    assert np.frombuffer(s[0, :4].numpy().tobytes(), "<f4")[0] == 1.0  # R = max|x| / 7
    assert s[0, 4] == 0 and quant.STEPS[s[0, 5]] >= 0.5 / 7 > quant.STEPS[s[0, 5] + 1]
    back = quant.dequantize(q, s, "int4")
    assert back[0, 0] == 7.0 and back[0, 1] == -1.0 and back[0, 2] == 3.0  # the max group's step is R exactly
    assert abs(float(back[0, 33]) - 0.5) <= quant.STEPS[s[0, 5]] / 2


def test_int8_format_as_documented():
    """docs/STORE.md, "int8 and int4": one int8 a channel, R = max|x| / 127 in the scale's first 4 bytes, a code per
    group of 32 channels; the group holding the row's max decodes it exactly, another within half its step."""
    x = torch.zeros(1, 40)
    x[0, 1], x[0, 2], x[0, 35] = -254.0, 3.0, 0.5  # group 0: max 254 (R = 2), group 1 (8 channels): max 0.5
    q, s = quant.quantize(x, "int8")
    assert q.dtype == torch.int8 and q.shape == (1, 40) and s.shape == (1, 4 + 2) and s.dtype == torch.uint8
    assert q[0, 1] == -127 and q[0, 2] == 2  # 3 / 2 = 1.5 rounds to even
    assert np.frombuffer(s[0, :4].numpy().tobytes(), "<f4")[0] == 2.0 and s[0, 4] == 0
    assert quant.STEPS[s[0, 5]] >= 0.5 / 254 > quant.STEPS[s[0, 5] + 1]
    back = quant.dequantize(q, s, "int8")
    assert back[0, 1] == -254.0 and back[0, 2] == 4.0 and abs(float(back[0, 35]) - 0.5) <= 2 * quant.STEPS[s[0, 5]] / 2


def test_int4_never_stores_minus_8():
    """The quantizer relies on every group's step reaching its max / 7 instead of clamping: over rows built to
    stress the rounding (values at and just under each group's max, massive channels, tiny groups beside huge
    ones, bf16 inputs) no nibble is 0x8 (-8, outside the format's [-7, 7]), and no int8 is -128."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 256, generator=g) * torch.logspace(-6, 4, 4096).unsqueeze(1)
    x[::3, ::32] = x[::3].abs().amax(-1, keepdim=True) * (1 - 1e-7)  # at the row max in every group
    x[1::3, 5] *= 1e4  # a massive channel
    for rows in (x, x.bfloat16(), -x):
        q, _ = quant.quantize(rows, "int4")
        assert not ((q & 15) == 8).any() and not ((q >> 4) == 8).any()
        assert not (quant.quantize(rows, "int8")[0] == -128).any()  # int8's range is [-127, 127] the same way
    # rows whose R = max / Q is a float32 subnormal (max under ~1e-38): rounding there once wrapped to -128 / -8
    tiny = torch.zeros(4, 64)
    tiny[:, 0] = torch.tensor([128.0, 129.0, 8.0, 9.0]) * 2.0**-149
    assert not (quant.quantize(tiny, "int8")[0] == -128).any() and (quant.quantize(tiny, "int8")[0] >= 0).all()
    q4, _ = quant.quantize(tiny, "int4")
    assert not ((q4 & 15) == 8).any() and not ((q4 >> 4) == 8).any()


def test_int4_steps_table_is_exact_and_portable():
    """STEP[c] = float32(2^(-c/16)): exact powers of two every 16 codes, decreasing, and each float64 value far
    enough from a float32 rounding midpoint that any libm's 2.0 ** x rounds to the same float32 (a reader in
    another language computes the same table)."""
    t = quant.STEPS
    assert t.dtype == np.float32 and t[0] == 1.0 and (np.diff(t) < 0).all()
    assert all(t[16 * k] == 2.0**-k for k in range(16))
    v = 2.0 ** (-np.arange(256) / 16)
    below = t.astype(np.float64)
    other = np.where(v > below, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(0)))
    mid = (below + other.astype(np.float64)) / 2
    assert (np.abs(v - mid) > 1e-6 * np.abs(below - other)).all()


def test_int4_zero_nonfinite_and_partial_groups():
    """An all-zero row and an all-zero group decode to zeros; a row with a NaN or an infinity to NaN (validation
    reports it); a partial last group and an odd hidden size (refused, naming the fix)."""
    x = torch.randn(5, 40)  # 40 channels: groups of 32 and 8
    x[0] = 0
    x[1, 3] = math.nan
    x[2, 39] = math.inf
    x[3, :32] = 0
    q, s = quant.quantize(x, "int4")
    back = quant.dequantize(q, s, "int4")
    assert torch.equal(back[0], torch.zeros(40)) and torch.equal(back[3, :32], torch.zeros(32))
    assert torch.isnan(back[1]).all() and torch.isnan(back[2]).all()
    assert torch.isfinite(back[[0, 3, 4]]).all()
    assert rel(back[4], x[4]) < 0.15 and rel(back[3, 32:], x[3, 32:]) < 0.15
    assert torch.equal(quant.dequantize(torch.zeros_like(q), torch.zeros_like(s), "int4"), torch.zeros(5, 40))
    with pytest.raises(ValueError, match="even hidden size.*fp8 or int8"):
        quant.quantize(torch.randn(2, 33), "int4")


def test_int4_of_bf16_rows_is_int4_of_their_float32_values():
    """The worker quantizes bf16 rows without a float32 copy (maxima in bf16, the division widened on the fly): the
    stored bytes equal those of the same values given as float32, massive activations, zeros, NaN and inf included;
    an all-zero row's reference is +0.0 whatever the zeros' sign."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 3, 4096 + 48, generator=g) * torch.logspace(-6, 3, 64).view(64, 1, 1)
    x[0, 0], x[1, 1] = 0.0, -0.0
    x[2, 0, 7], x[3, 2, 4100] = 3000.0, -1.0e4  # massive activations (one in the partial last group)
    x[4, 1, 9], x[5, 2, 0] = math.nan, -math.inf
    xb = x.to(torch.bfloat16)
    qb, sb = quant.quantize(xb, "int4")
    qf, sf = quant.quantize(xb.float(), "int4")
    assert torch.equal(qb, qf) and torch.equal(sb, sf)
    ref = sb[..., : quant.SCALE_HEADER].contiguous().view(torch.int32).squeeze(-1)
    assert ref[0, 0] == 0 and ref[1, 1] == 0  # +0.0's bits, not -0.0's
    assert torch.isnan(sb[4, 1, : quant.SCALE_HEADER].clone().view(torch.float32)).all()


def test_bytes_per_token_of_the_8b_and_27b_shapes():
    """int4 at most 0.28 of raw bf16 on the benches' shapes (5 captured layers), scales, ids and mask included;
    int8 a code byte per 32 channels more than one float32 per row."""
    for hidden, figure in ((4096, 10_905), (5120, 13_625)):
        raw = 5 * hidden * 2
        shapes = quant.row_shapes("int4", np.dtype("uint16"), 5, hidden)
        per_token = sum(int(np.prod(shapes[a][0])) * shapes[a][1].itemsize for a in ("hidden", "hidden_scale"))
        assert per_token == 5 * quant.row_bytes("int4", hidden) and per_token + 4 + 1 == figure  # ids, mask
        assert figure / raw <= 0.28
        assert quant.row_bytes("fp8", hidden) == quant.row_bytes(quant.INT8_ROW, hidden) == hidden + 4
        assert quant.row_bytes("int8", hidden) == hidden + 4 + hidden // 32  # 0.516 of bf16's 2 * hidden
        assert quant.row_bytes("full", hidden) == 2 * hidden


def test_the_scheme_of_a_version_from_its_attributes():
    """`precision` absent: full; int8 without `int8_scales`: the older one step per row; an unknown layout is an
    error naming the attribute (never decoded as something else)."""
    from dflash_pipeline.errors import StoreError

    assert quant.scheme({}) == "full" and quant.scheme({"precision": "int4"}) == "int4"
    assert quant.scheme({"precision": "int8"}) == quant.INT8_ROW
    assert quant.scheme(quant.precision_attrs("int8")) == "int8"
    assert quant.precision_attrs("fp8") == {"precision": "fp8"}
    with pytest.raises(StoreError, match="int8_scales='group64' is not 'group32'"):
        quant.scheme({"precision": "int8", "int8_scales": "group64"})


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_steps_of_one_row_of_a_layer_slice(precision):
    """validate's recompute takes scale[:, j] (one layer of a sample's rows): a one-token sample's R bytes then
    sit at an offset that is no multiple of 4 when H is not a multiple of 128 (H 64 here; it raised)."""
    x = torch.randn(1, 3, 64)
    q, s = quant.quantize(x, precision)
    for j in range(3):
        steps = quant.group_steps(s[:, j])
        assert torch.equal(steps, torch.from_numpy(quant.group_steps(s[:, j].numpy())))
        assert quant.error_bound(precision, s[:, j], x[:, j]) > 0


def test_an_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="'int3'.*int4.*extract.store_precision"):
        quant.check_precision("int3")


def test_the_config_offers_every_precision():
    from typing import get_args

    from dflash_pipeline.extraction.config import ExtractConfig

    assert get_args(ExtractConfig.model_fields["store_precision"].annotation) == quant.PRECISIONS
