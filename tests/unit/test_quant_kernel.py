"""storage/quant_gpu.py's Triton kernel against the eager grouped quantization, run by Triton's interpreter on the
CPU (TRITON_INTERPRET=1, in a fresh process: the variable must be set before the kernel is defined). The GPU runs
the same kernel compiled and checks it against eager once per variant (quant_gpu.kernel_for); the interpreter runs
numpy's float32 arithmetic, so this test holds the kernel's logic (codes, ties, non-finite and subnormal rows,
packing, partial groups) to eager's bytes; `bash bench/device.sh quant` compares the compiled kernel's bytes with
eager's on a GPU."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r"""
import torch
from dflash_pipeline.storage import quant, quant_gpu

assert quant_gpu.triton is not None
# (widths: a partial last group, an odd width (int8 only), the 8B shape's; each dtype the kernel takes)
for dtype, hidden in [(d, h) for d in quant_gpu.DTYPES for h in (1000, 33)] + [(torch.bfloat16, 4096)]:
    assert quant_gpu._agrees(torch.device("cpu"), dtype, hidden), ("probe rows differ from eager", dtype, hidden)
gen = torch.Generator().manual_seed(0)
for shape in ((5, 3, 4096), (7, 5120), (2, 4, 96), (0, 64)):
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    if x.numel():
        x[..., 7] *= 300
        x.view(-1, shape[-1])[0] = 0
    for p in quant.GROUPED:
        q, s = quant_gpu.quantize(x, p)
        q_ref, s_ref = quant._quantize_grouped_eager(x, p)
        assert q.shape == q_ref.shape and s.shape == s_ref.shape, (shape, p)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (shape, p)
print("ok")
"""


def test_kernel_gives_eager_bytes():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
