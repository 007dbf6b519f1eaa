"""How far a compiled forward (extract.compile) is from the eager one, against validation's tolerance.

    python bench/compile_numerics.py                 # CPU, bf16, random-weight 36-layer Qwen3-style model

Prints, per decoder layer, the relative L2 error (the metric target/validate.py checks) of (1) the forward
with whole decoder layers compiled and (2) with the RMSNorms compiled, against the eager forward of the same
sample, and beside them (3) the eager forward of that sample padded into a batch with a longer one: the
batch-shape noise the validation tolerance was set for.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_pipeline.extraction.loader import compile_modules
from dflash_pipeline.extraction.validate import TOLERANCE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=128,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(args.device).eval()
    ids = torch.randint(10, 2000, (1, args.tokens), device=args.device)

    @torch.inference_mode()
    def states(x):
        return model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states

    eager = states(ids)
    longer = torch.randint(10, 2000, (1, args.tokens * 3 // 2), device=args.device)
    padded = states(torch.cat([torch.nn.functional.pad(ids, (0, longer.shape[1] - args.tokens)), longer]))
    runs = {}
    for mode in ("layers", "norms"):
        compile_modules(model, mode)
        torch._dynamo.reset()
        t = time.monotonic()
        runs[mode] = states(ids)
        print(f"compile={mode}: compiled and ran in {time.monotonic() - t:.1f} s")
    compile_modules(model, "off")

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    print(f"relative L2 error against the eager batch-1 forward (validation's bf16 tolerance: {TOLERANCE['bfloat16']})")
    print("layer | compile=layers | compile=norms | eager, padded into a batch")
    for i in sorted({1, args.layers // 4, args.layers // 2, 3 * args.layers // 4, args.layers - 3, args.layers}):
        print(
            f"{i} | {rel(runs['layers'][i][0], eager[i][0]):.2e} | {rel(runs['norms'][i][0], eager[i][0]):.2e} | "
            f"{rel(padded[i][0, : args.tokens], eager[i][0]):.2e}"
        )


if __name__ == "__main__":
    main()
