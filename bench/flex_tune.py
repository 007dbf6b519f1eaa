"""FlexAttention tile sizes for the drafter's block mask (issue 30): forward + backward time per configuration.

    python bench/flex_tune.py --out $OUT                 # on the GPU: 8B and 27B drafter attention shapes
    python bench/flex_tune.py --out /tmp/ft --cpu-smoke  # checks the script (CPU flex, tiny shape), measures nothing

The drafter's attention (drafter/flex.py): per row, 512 blocks of 16 queries, each seeing the context before its
anchor and its own block; keys = context + all blocks. Each configuration is a BlockMask block size (query, key)
and torch FlexKernelOptions, or the default's tiles over query groups (train.attention_groups); all are checked
against the default's output and gradients, then timed (CUDA events, median of --iters forward+backward). Useful
FLOPs: 4 * heads * head_dim * visible pairs forward, 2.5x that backward. Writes flex_tune.json, and the fastest
exact tile configuration as flex_best.json (what train_bench's `flex=PATH` variant loads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflash_pipeline.drafter import flex

SHAPES = {"8b": (32, 8, 128), "27b": (24, 4, 256), "tiny": (4, 2, 16)}  # heads, kv heads, head dim

# (name, mask block (q, kv), kernel options)
CONFIGS = [
    ("default", (128, 128), {}),
    ("rows-safe", (128, 128), {"ROWS_GUARANTEED_SAFE": True}),
    ("mask64", (64, 64), {}),
    ("mask64-kv128", (64, 128), {}),
    ("mask128-kv64", (128, 64), {}),
    ("fwd64", (128, 128), {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}),
    ("bwd-64-128", (128, 128), {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64}),
    ("bwd-32-128", (128, 128), {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32}),
    (
        "bwd-64-64-w8",
        (128, 128),
        {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64, "bwd_num_warps": 8},
    ),
    ("bwd-w8-s3", (128, 128), {"bwd_num_warps": 8, "bwd_num_stages": 3}),
    ("bwd-w4-s2", (128, 128), {"bwd_num_warps": 4, "bwd_num_stages": 2}),
    ("no-write-dq", (128, 128), {"WRITE_DQ": False}),
]
# train.attention_groups (drafter/flex.py QueryGroups), with the default tiles: reported beside the tiles, chosen in
# training (train_bench.py's attention_groups=N variants), not written to flex_best.json
GROUPS = (2, 4, 8, 16)


def inputs(shape: str, ctx_len: int, anchors: int, block: int, device: str, seed: int = 0):
    nh, nkv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    a = torch.randperm(ctx_len - block, generator=g)[:anchors].sort().values[None] + 1
    q_len = anchors * block
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    q = torch.randn(1, nh, q_len, d, generator=g).to(device, dt)
    k = torch.randn(1, nkv, ctx_len + q_len, d, generator=g).to(device, dt)
    v = torch.randn(1, nkv, ctx_len + q_len, d, generator=g).to(device, dt)
    do = torch.randn(1, nh, q_len, d, generator=g).to(device, dt)
    pairs = block * int(a.sum()) + q_len * block
    return a.to(device), q, k, v, do, pairs, nh, d


def run_config(mask_block, options, a, q, k, v, do, block, iters, device, groups=1):
    flex.MASK_BLOCK, flex.KERNEL_OPTIONS = mask_block, options
    mask = flex.block_sparse_mask(a, None, k.shape[2] - q.shape[2], block, groups=groups)
    qs, ks, vs = (x.detach().clone().requires_grad_(device != "cpu") for x in (q, k, v))
    attend = flex.grouped_attention if groups > 1 else flex.flex_attention

    def once():
        for x in (qs, ks, vs):
            x.grad = None
        out = attend(qs, ks, vs, mask, enable_gqa=q.shape[1] != k.shape[1])
        if device != "cpu":  # (no FlexAttention backward on CPU: the smoke times the forward)
            out.backward(do)
        return out

    out = once()  # compile
    once()
    times = []
    for _ in range(iters):
        if device == "cpu":
            t = time.perf_counter()
            once()
            times.append((time.perf_counter() - t) * 1e3)
        else:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            once()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2], [x for x in (out.detach(), qs.grad, ks.grad, vs.grad) if x is not None]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8b,27b")
    p.add_argument("--ctx", default="900,2048", help="context lengths (the bench store's median is ~900)")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--configs", default="", help="only these configurations, comma-separated (e.g. default,groups-8)")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:
        args.shapes, args.ctx, args.anchors, args.block, args.iters = "tiny", "64", 8, 4, 2
        from torch.nn.attention.flex_attention import flex_attention as eager

        flex._compiled = lambda: eager  # (inductor's CPU flex kernel needs a full C++ toolchain)
    only = {c.strip() for c in args.configs.split(",") if c.strip()}
    unknown = only - {c[0] for c in CONFIGS} - {f"groups-{n}" for n in GROUPS}
    if unknown or (only and "default" not in only):
        p.error(
            f"--configs: unknown {sorted(unknown)}" if unknown else "--configs must include default (the reference)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        for ctx_len in (int(c) for c in args.ctx.split(",")):
            a, q, k, v, do, pairs, nh, d = inputs(shape, ctx_len, args.anchors, args.block, device)
            flops = 4 * nh * d * pairs * 3.5  # forward + 2.5x backward
            ref = None
            grouped = [(f"groups-{n}", (128, 128), {}, n) for n in GROUPS]
            for name, mb, opts, groups in [(*c, 1) for c in CONFIGS] + grouped:
                if only and name not in only:
                    continue
                row = {"shape": shape, "ctx": ctx_len, "config": name, "mask_block": mb, "options": opts}
                try:
                    ms, res = run_config(mb, opts, a, q, k, v, do, args.block, args.iters, device, groups)
                except Exception as e:  # noqa: BLE001 - a configuration the kernel rejects is a result, not a failure
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{shape} ctx {ctx_len} {name}: {row['error']}", flush=True)
                    rows.append(row)
                    continue
                if ref is None:
                    ref = res
                err = max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(res, ref))
                row.update(ms=ms, tflops=flops / ms / 1e9, max_rel_err=err)
                print(
                    f"{shape} ctx {ctx_len} {name}: {ms:.3f} ms, {row['tflops']:.0f} TFLOP/s, err {err:.2e}", flush=True
                )
                rows.append(row)
    flex.MASK_BLOCK, flex.KERNEL_OPTIONS = (128, 128), {}
    (out / "flex_tune.json").write_text(json.dumps(rows, indent=2))
    # the fastest tile configuration, and apart from it the fastest query-group count (the default's tiles: groups=1)
    tiles = fastest(rows, lambda c: not c.startswith("groups-"))
    if tiles is None:
        print("no configuration ran: see the errors above", file=sys.stderr)
        return 1
    best, ms, n = tiles
    cfg = next(c for c in CONFIGS if c[0] == best)
    (out / "flex_best.json").write_text(json.dumps({"config": best, "mask_block": cfg[1], "kernel_options": cfg[2]}))
    default_ms = sum(r["ms"] for r in rows if r["config"] == "default" and "ms" in r)
    print(f"fastest: {best} ({ms:.2f} ms vs default {default_ms:.2f} ms, {n} cases)")
    best, ms, n = fastest(rows, lambda c: c == "default" or c.startswith("groups-"))
    groups = 1 if best == "default" else int(best.removeprefix("groups-"))
    (out / "groups_best.json").write_text(json.dumps({"attention_groups": groups, "ms": ms, "default_ms": default_ms}))
    print(f"fastest query groups: {groups} ({ms:.2f} ms vs default {default_ms:.2f} ms, {n} cases)")
    return 0


def fastest(rows: list[dict], eligible) -> tuple[str, float, int] | None:
    """The eligible configuration with the least total time over every shape and context it ran in all of, among
    those exact to the default's: (name, total ms, cases)."""
    ok: dict[str, list[float]] = {}
    for r in rows:
        if "ms" in r and r["max_rel_err"] < 2e-2 and eligible(r["config"]):
            ok.setdefault(r["config"], []).append(r["ms"])
    if not ok:
        return None
    n = max(len(v) for v in ok.values())
    best = min((c for c, v in ok.items() if len(v) == n), key=lambda c: sum(ok[c]))
    return best, sum(ok[best]), n


if __name__ == "__main__":
    sys.exit(main())
