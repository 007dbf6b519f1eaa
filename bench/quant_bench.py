"""What each compact store precision costs the extraction worker on the GPU (issue 29 item 4: quantization must
not cost more than 2% of the forward): storage/quant.py's `quantize` timed on one batch of captured rows of the
8B shape (5 layers x 4096) and the 27B shape (5 layers x 5120), 16,384 tokens (the benches' batch of 8 x 2048),
bf16 as the capture hooks produce it, one channel 300x the others (a massive activation, as trained LLMs have;
random rows otherwise: the error figures are the scheme's, not a trained model's). Reported per precision: the
bytes per token stored (values + scales) against raw bf16; the reconstruction error (relative L2 overall, on the
massive channel, on the others); the share of the forward the quantization adds, against the pipeline's measured
forward rates (bench/RESULTS.md: 8B 41,300 tokens/s, 27B hybrid 11,665 tokens/s on one H200).

    python bench/quant_bench.py --out bench-out       # (bench/device.sh quant)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_pipeline.storage import quant, quant_gpu

SHAPES = {"8b": (5, 4096, 41_300.0), "27b": (5, 5120, 11_665.0)}


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls (after two warm-up calls), synchronized on CUDA."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def stored_bytes(q, scale) -> int:
    return q.numel() * q.element_size() + scale.numel() * scale.element_size()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    rows = []
    for name, (layers, hidden, fwd_tps) in SHAPES.items():
        x = torch.randn(args.tokens, layers, hidden, device=dev).to(torch.bfloat16)
        x[:, :, 7] *= 300.0  # a massive-activation channel, as trained LLMs have
        raw = args.tokens * layers * hidden * 2
        fwd_s = args.tokens / fwd_tps
        for p in quant.PRECISIONS:
            if p == "full":
                continue
            s = timed(lambda p=p, x=x: quant.quantize(x, p), args.reps)
            key = (x.device, x.dtype, hidden)
            kernel = p in quant.GROUPED and x.is_cuda and quant_gpu.kernel_for(*key) is not None
            eager_s = None
            if kernel:  # the eager path, for comparison (and its bytes must be the kernel's)
                quant_gpu._CHECKED[key] = None
                eager_s = timed(lambda p=p, x=x: quant.quantize(x, p), args.reps)
                q_eager, s_eager = quant.quantize(x, p)
                quant_gpu._CHECKED[key] = quant_gpu.quantize
            q, scale = quant.quantize(x, p)
            b = stored_bytes(q, scale)
            y = quant.dequantize(q, scale, p, torch.float32)
            xf = x.float()
            err = (y - xf).norm() / xf.norm()
            rest = torch.ones(hidden, dtype=torch.bool, device=dev)
            rest[7] = False
            err_rest = (y - xf)[..., rest].norm() / xf[..., rest].norm()
            err_massive = (y - xf)[..., 7].norm() / xf[..., 7].norm()
            # The same rows quantized on the CPU (and by the eager tail on this device, where the Triton kernel ran),
            # and the GPU's bytes decoded on the CPU: the store must not depend on where it was written or read (the
            # reader decodes with numpy, training on the GPU).
            qc, sc = quant.quantize(x[:1024].cpu(), p)
            same_bytes = bool(torch.equal(qc, q[:1024].cpu()) and torch.equal(sc, scale[:1024].cpu()))
            y_cpu = quant.dequantize(q[:1024].cpu(), scale[:1024].cpu(), p, torch.float32)
            same_decode = bool(torch.equal(y_cpu, y[:1024].cpu()))
            if kernel:
                same_bytes = same_bytes and bool(torch.equal(q_eager, q) and torch.equal(s_eager, scale))
            rows.append(
                {
                    "shape": name,
                    "precision": p,
                    "quantize_ms": round(s * 1e3, 3),
                    "share_of_forward": round(s / fwd_s, 5),
                    "triton_kernel": kernel,
                    **({"quantize_ms_eager": round(eager_s * 1e3, 3)} if kernel else {}),
                    "bytes_per_token": b / args.tokens,
                    "of_raw_bf16": round(b / raw, 4),
                    "GB_per_s": round(raw / s / 1e9, 1),
                    "rel_l2": float(err),
                    "rel_l2_other_channels": float(err_rest),
                    "rel_l2_massive_channel": float(err_massive),
                    "cpu_quantize_bit_equal": same_bytes,
                    "cpu_decode_bit_equal": same_decode,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_bench.json").write_text(
        json.dumps({"device": device, "tokens": args.tokens, "torch": torch.__version__, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
