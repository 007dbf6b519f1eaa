"""Numerics of the hybrid's GPU kernels, per layer: extract.conv_kernel=fla and extract.gdn_forward=fused against
transformers' forward with its PyTorch convolution.

A 27B-shaped hybrid cut to 8 layers (6 Gated DeltaNet + 2 full attention; random weights), batch of 4 x 2048
tokens. Each layer's output in bf16 with each variant ('transformers': its forward and PyTorch convolution;
'fla': its forward with fla's convolution; 'fused': our Gated DeltaNet forward on fla's kernels) is compared with
a float32 forward (transformers, PyTorch convolution): relative L2 error. Deep random-weight stacks amplify
rounding chaotically, so the comparison is per layer and against the fp32 reference, not bf16 against bf16 at
the last layer.

    python3 bench/conv_kernel_check.py --out $OUT/conv
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from common import SHAPES, log


def layer_outputs(model, ids) -> list[torch.Tensor]:
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    return [h.float() for h in hs[1:-1]]  # decoder layers 0..L-2 (the last is post-norm in HF's tuple)


def main() -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_pipeline.extraction.kernels import use_conv_kernel, use_gdn_forward

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    spec = dict(SHAPES["27b"], num_hidden_layers=args.layers)
    spec["layer_types"] = spec["layer_types"][: args.layers]
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref_model = AutoModelForCausalLM.from_config(cfg).float().eval()
    ids = torch.randint(10, 200_000, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    use_conv_kernel("transformers")
    ref = layer_outputs(ref_model, ids)
    model = ref_model.to(torch.bfloat16)
    res = {"layer_types": spec["layer_types"]}
    for kernel in ("transformers", "fla", "fused"):
        use_conv_kernel("fla" if kernel == "fla" else "transformers")
        n = use_gdn_forward(model, "fused" if kernel == "fused" else "transformers")
        if kernel == "fused":
            res["fused_layers"] = n  # 6 expected: every Gated DeltaNet layer
        out = layer_outputs(model, ids)
        res[kernel] = [((o - r).norm() / r.norm()).item() for o, r in zip(out, ref)]
        log(f"{kernel}: rel L2 vs fp32 per layer {[round(x, 5) for x in res[kernel]]}")
    use_conv_kernel("transformers")
    use_gdn_forward(model, "transformers")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "conv_kernel_check.json").write_text(json.dumps(res, indent=2))
    for kernel in ("fla", "fused"):
        worst = max(b - a for a, b in zip(res["transformers"], res[kernel]))
        log(f"{kernel} minus transformers, worst layer: {worst:+.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
