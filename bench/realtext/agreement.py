"""The ceiling a drafter's training data sets on its acceptance length (issue 28 item 3).

Speculative decoding accepts a drafted token only where it equals the target's own greedy choice. A drafter that
reproduced its training data perfectly would therefore accept, from an anchor t, as many tokens as the data keeps
agreeing with the target's greedy prediction: the run of positions t+1, t+2, ... with argmax(logits[j-1]) ==
token[j], at most block_size - 1, plus the one token every verification step yields. Its mean over the data's
supervised anchors is the tau such a drafter would reach on that data (teacher-forced: one target forward per
sequence, no generation):

- on the store's sequences (the replies regenerated greedily by the target itself): near block_size when the
  regeneration was greedy and exact; less where bf16 batched decoding drifted from a single-sequence forward;
- on the held-out prompts with the packages' own code as the reply (`reference`): what a drafter trained on the
  human-written replies could at best reach, the reason to regenerate.

    python bench/realtext/agreement.py --target runs/realtext/target --store runs/realtext/pipeline/store \
        --heldout runs/realtext/chat/heldout_prompts.jsonl --block-size 16 --out runs/realtext/agreement.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def run_lengths(agree: torch.Tensor, cap: int) -> torch.Tensor:
    """agree [T] bool (agree[j]: token j+1 equals the greedy choice after tokens 0..j) -> [T] the number of
    consecutive agreeing positions from each anchor, at most `cap`."""
    t = agree.numel()
    runs = torch.zeros(t + 1, dtype=torch.long)
    for j in range(t - 1, -1, -1):  # runs[j] = agree[j] * (1 + runs[j+1]): one reverse scan
        runs[j] = (runs[j + 1] + 1) if agree[j] else 0
    return runs[:t].clamp(max=cap)


@torch.inference_mode()
def ceiling(model, sequences: list[tuple[list[int], list[bool]]], block_size: int) -> dict:
    """Mean of 1 + run length over supervised anchors (an anchor t: token t supervised and t + 1 too), the share of
    supervised next tokens equal to the greedy choice, and the per-position acceptance of the ideal drafter."""
    dev = next(model.parameters()).device
    total_anchor, total_len, agree_n, agree_d = 0, 0, 0, 0
    at_least = torch.zeros(block_size, dtype=torch.long)
    for ids, mask in sequences:
        x = torch.tensor([ids], device=dev)
        greedy = model(input_ids=x, use_cache=False).logits[0].argmax(-1).cpu()  # greedy[j]: choice for j + 1
        tok = torch.tensor(ids)
        m = torch.tensor(mask, dtype=torch.bool)
        agree = (greedy[:-1] == tok[1:]) & m[1:]  # [T-1]
        agree_n += int(agree.sum())
        agree_d += int(m[1:].sum())
        runs = run_lengths(agree, block_size - 1)
        anchors = m[:-1] & m[1:]
        r = runs[anchors]
        total_anchor += r.numel()
        total_len += int((r + 1).sum())
        for k in range(1, block_size):
            at_least[k] += int((r >= k).sum())
    return {
        "sequences": len(sequences),
        "anchors": total_anchor,
        "greedy_agreement": agree_n / max(agree_d, 1),
        "tau_ceiling": total_len / max(total_anchor, 1),
        "position_accept_rate": [int(at_least[k]) / max(total_anchor, 1) for k in range(1, block_size)],
    }


def store_sequences(store: Path, n: int) -> list[tuple[list[int], list[bool]]]:
    from dflash_pipeline.storage.reader import HiddenStateDataset

    ds = HiddenStateDataset(store)
    step = max(len(ds) // n, 1)
    out = []
    for i in range(0, len(ds), step)[:n]:
        item = ds[i]
        out.append((item["input_ids"].tolist(), item["loss_mask"].tolist()))
    ds.close()
    return out


def heldout_sequences(path: Path, tok, n: int, max_len: int) -> list[tuple[list[int], list[bool]]]:
    """Each held-out prompt rendered with the package's own code as the assistant reply; the reply supervised."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    out = []
    for r in rows:
        prompt = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        full = prompt + r["reference"] + "<|im_end|>"
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"][:max_len]
        out.append((ids, [i >= len(p_ids) for i in range(len(ids))]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--heldout", type=Path, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    result: dict = {"target": str(args.target), "block_size": args.block_size, "dtype": str(dtype), "device": dev}
    t = time.monotonic()
    if args.store:
        result["regenerated_store"] = ceiling(model, store_sequences(args.store, args.samples), args.block_size)
    if args.heldout:
        seqs = heldout_sequences(args.heldout, tok, args.samples, args.max_length)
        result["heldout_human_code"] = ceiling(model, seqs, args.block_size)
    result["seconds"] = time.monotonic() - t
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for k in ("regenerated_store", "heldout_human_code"):
        if k in result:
            r = result[k]
            print(
                f"{k}: greedy agreement {r['greedy_agreement']:.3f}, tau ceiling {r['tau_ceiling']:.2f} "
                f"({r['sequences']} sequences, {r['anchors']} anchors)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
