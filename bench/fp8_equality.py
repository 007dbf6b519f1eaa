"""Issue 31 item 3: how far the states an FP8 target stores are from the forwards users would compare them with,
per captured layer, on the bench's random-weight shapes (weights quantized in memory to the published block-wise
format, as `bench/device.sh fp8` does):

  kernel        the FP8 forward as extraction runs it (torch's block-scaled GEMM on a GPU) against the same
                arithmetic emulated (the quantized operands dequantized, multiplied in float32): the GEMM's exactness
  transformers  against transformers' own forward of the same checkpoint as an offline machine runs it
                (FineGrainedFP8Config(dequantize=True): bf16 weights = e4m3 x block scale, activations not
                quantized; its FP8-kernel path needs the hub kernel kernels-community/finegrained-fp8)
  bf16 source   against the bf16 model the checkpoint was quantized from (how far FP8-target states are from
                bf16-target states)
  noise floor   the bf16 model against itself with each sample in its own batch (how much a different batch shape
                alone moves bf16 states: rounding grows chaotically through random layers, so read the rows above
                against this one)

Relative L2 per layer (||a - b|| / ||b|| over every captured row), twice: "through the model" (what the store
holds: each forward from the tokens on, so differences compound layer after layer, and an FP8 forward re-quantizes
every linear's input, turning a one-ulp difference upstream into a whole e4m3 step) and "one layer" (each captured
layer run alone on the bf16 source model's own input to it: what one layer of each forward adds). Samples:
--samples sequences of --length random tokens, unpadded, with the pipeline's kernels (capture hooks, early stop).

    python bench/fp8_equality.py --shape 27b --out bench-out       # (bench/device.sh fp8-equality)
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from common import SHAPES, build_model, log

from dflash_pipeline.extraction import fp8_linear
from dflash_pipeline.extraction.capture import LayerCapture
from dflash_pipeline.extraction.layers import dflash_layer_ids
from dflash_pipeline.extraction.loader import base_model, decoder_layers
from dflash_pipeline.extraction.quantized import dequantize_fp8


def states(model, layer_ids: list[int], batches: list[torch.Tensor]) -> torch.Tensor:
    """[N, K, H] float32 on the host: every token of every batch, the captured layers in order."""
    capture = LayerCapture(model, layer_ids)
    out = []
    for ids in batches:
        rows = torch.arange(ids.numel(), device=ids.device)
        hidden, _ = capture.packed(ids, None, rows)
        out.append(hidden.float().cpu())
    return torch.cat(out)


@torch.inference_mode()
def layer_inputs(model, layer_ids: list[int], ids: torch.Tensor) -> dict[int, tuple]:
    """{layer id: (args, kwargs, output)} of one full forward: each chosen decoder layer's call as the model made it."""
    layers, got = decoder_layers(model), {}

    def before(i):
        return lambda _m, args, kwargs: got.__setitem__(i, [args, kwargs])

    def after(i):
        return lambda _m, _args, _kwargs, out: got[i].append(out[0] if isinstance(out, tuple) else out)

    handles = [layers[i].register_forward_pre_hook(before(i), with_kwargs=True) for i in layer_ids]
    handles += [layers[i].register_forward_hook(after(i), with_kwargs=True) for i in layer_ids]
    try:
        base_model(model)(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


@torch.inference_mode()
def one_layer(model, calls: dict[int, tuple]) -> torch.Tensor:
    """[N, K, H] float32 on the host: each layer of `calls` run alone on its recorded input."""
    layers, out = decoder_layers(model), []
    for i, (args, kwargs, _) in calls.items():
        y = layers[i](*args, **kwargs)
        y = y[0] if isinstance(y, tuple) else y
        out.append(y.float().reshape(-1, y.shape[-1]).cpu())
    return torch.stack(out, dim=1)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Per layer (axis 1) ||a - b|| / ||b||."""
    return [float((a[:, j] - b[:, j]).norm() / b[:, j].norm()) for j in range(a.shape[1])]


@contextmanager
def forward_mode(mode: str):
    """'fp8' as extraction runs it; 'emulated' (the float32 emulation on every device); 'dequantized' (weights
    dequantized to the activations' dtype, activations not quantized: transformers' dequantize=True forward)."""
    saved_ok, saved_forward = dict(fp8_linear._KERNEL_OK), fp8_linear.BlockFP8Linear.forward

    def dequantized(self, x):
        w = dequantize_fp8(self.weight, self.weight_scale_inv, self.block).to(x.dtype)
        return torch.nn.functional.linear(x, w, self.bias)

    try:
        if mode == "emulated":
            fp8_linear._KERNEL_OK.update({i: False for i in range(torch.cuda.device_count())})
        elif mode == "dequantized":
            fp8_linear.BlockFP8Linear.forward = dequantized
        yield
    finally:
        fp8_linear._KERNEL_OK.clear()
        fp8_linear._KERNEL_OK.update(saved_ok)
        fp8_linear.BlockFP8Linear.forward = saved_forward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--block", type=int, default=128, help="FP8 weight block (published checkpoints: 128)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args(argv)
    from dflash_pipeline.extraction.kernels import fla_version, gdn_forward_choice, use_conv_kernel, use_gdn_forward

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.monotonic()
    model = build_model(args.shape, args.device, dtype)
    cfg = model.config
    layer_ids = dflash_layer_ids(cfg.num_hidden_layers, 5)
    hybrid = "linear_attention" in (getattr(cfg, "layer_types", None) or [])
    if hybrid and cuda and fla_version():  # the pipeline's kernels on this machine (its probe's auto choices)
        use_conv_kernel("fla")
        use_gdn_forward(model, gdn_forward_choice("auto", hybrid, cfg.model_type, fla_version(), cuda))
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.samples, args.length), generator=gen).to(args.device)
    batched, alone = [ids], [ids[i : i + 1] for i in range(args.samples)]

    ref = states(model, layer_ids, batched)
    calls = layer_inputs(model, layer_ids, ids)
    ref_one = torch.stack([calls[i][2].float().reshape(-1, cfg.hidden_size).cpu() for i in layer_ids], dim=1)
    res: dict = {"shape": args.shape, "device": args.device, "layer_ids": layer_ids, "tokens": ids.numel()}
    res["noise_floor_bf16_batch_shape"] = rel_l2(states(model, layer_ids, alone), ref)
    res["fp8_linears"] = fp8_linear.quantize_model(model, (args.block, args.block))
    if cuda:
        torch.cuda.empty_cache()
    got, one = {}, {}
    for mode in ("fp8", "emulated", "dequantized"):
        with forward_mode(mode):
            got[mode] = states(model, layer_ids, batched)
            one[mode] = one_layer(model, calls)
            if mode == "fp8":
                res["fp8_matmul"] = "scaled_mm" if any(fp8_linear._KERNEL_OK.values()) else "emulated"
    for name, table in (("through_model", got), ("one_layer", one)):
        source = ref if name == "through_model" else ref_one
        res[name] = {
            "kernel_vs_emulated": rel_l2(table["fp8"], table["emulated"]),
            "fp8_vs_transformers_dequantized": rel_l2(table["fp8"], table["dequantized"]),
            "fp8_vs_bf16_source": rel_l2(table["fp8"], source),
            "dequantized_vs_bf16_source": rel_l2(table["dequantized"], source),
        }
    res["seconds"] = time.monotonic() - t0
    for k, v in res.items():
        for name, row in v.items() if isinstance(v, dict) else [(None, v)]:
            shown = [round(x, 5) for x in row] if isinstance(row, list) and k != "layer_ids" else row
            log(f"{k}{' ' + name if name else ''}: {shown}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fp8_equality_{args.shape}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
