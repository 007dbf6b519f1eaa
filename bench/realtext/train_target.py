"""Train the real-text benchmark target: a Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1 full attention, as
Qwen3.6) with its own byte-level BPE tokenizer, on the Python source and docstrings of the installed packages, with
whole packages held out (corpus.HELDOUT). Then its held-out loss and its hidden-state statistics (stats.py).

    python bench/realtext/train_target.py --out runs/realtext --minutes 6          # the GPU recipe (~70M params)
    python bench/realtext/train_target.py --out /tmp/rt --scale tiny               # CPU rehearsal, same code path

Writes under --out: target/ (HF checkpoint + tokenizer, loadable with from_pretrained; bf16 weights), chat/ (the
chat data, chat.py), target_report.json (recipe, data, loss curve, held-out loss, statistics of the trained and
of a randomly initialised model of the same shape). Deterministic: sorted file lists, fixed seeds; the number of
steps comes from the wall-clock budget (measured over the first steps) and is recorded, and `--steps N` replays it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat  # noqa: E402
import corpus  # noqa: E402
import stats  # noqa: E402

from dflash_pipeline.embedded.build import build_tokenizer  # noqa: E402

# Sizes. "gpu": ~70M parameters: the lower end of 50-150M because ~6 minutes of one H200 with transformers' PyTorch
# Gated DeltaNet (no flash-linear-attention kernels) trains on a few tens of millions of tokens, far below even the
# compute-optimal ~20 tokens per parameter of a smaller model, so a larger model would only be less trained; yet
# hidden 512 x 16 layers is wide and deep enough for outlier channels to form and keeps Qwen3.6's 3:1 pattern
# (12 GDN + 4 full attention, full at 3, 7, 11, 15) and its GQA / GDN head ratios (value heads = 2 x key heads).
SCALES = {
    "gpu": dict(
        model=dict(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=16,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_conv_kernel_dim=4,
        ),
        vocab=16384,
        tokenizer_mb=48,
        corpus_mb=240,
        seq=1024,
        batch=32,
        lr=1.5e-3,
        max_train_chats=3000,
        heldout_tokens=524288,
        stat_seqs=16,
    ),
    "tiny": dict(
        model=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_conv_kernel_dim=4,
        ),
        vocab=1024,
        tokenizer_mb=1,
        corpus_mb=2,
        seq=128,
        batch=4,
        lr=3e-3,
        max_train_chats=60,
        heldout_tokens=4096,
        stat_seqs=2,
    ),
}
CHAT_SHARE = 0.15  # share of training rows drawn from the rendered training conversations (the rest: raw source)
SEED = 0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def documents(files, cap_mb: float) -> tuple[list[str], dict]:
    """Documents of `files` in a seeded shuffled order up to `cap_mb` MB (the sorted list is shuffled with SEED)."""
    order = list(files)
    random.Random(SEED).shuffle(order)
    docs, size, skipped = [], 0, 0
    for f in order:
        text = corpus.read_text(f)
        if text is None or not text.strip():
            skipped += 1
            continue
        d = corpus.document(f, text)
        docs.append(d)
        size += len(d.encode())
        if size >= cap_mb * 1e6:
            break
    return docs, {"files": len(docs), "bytes": size, "skipped": skipped, "of_files": len(files)}


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """Documents joined by <|endoftext|> (fast tokenizer's batch encode: all cores)."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    enc = tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    ids: list[int] = []
    for e in enc:
        ids.extend(e.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def chat_stream(tok, rows: list[dict]) -> torch.Tensor:
    ids: list[int] = []
    for r in rows:
        ids.extend(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
    return torch.tensor(ids, dtype=torch.int32)


def make_model(tok, spec: dict, dev):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **spec,
    )
    torch.manual_seed(SEED)
    return Qwen3_5ForCausalLM(config).to(dev)


def batch_of(code: torch.Tensor, chats: torch.Tensor, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        src = chats if len(chats) > seq + 1 and torch.rand((), generator=gen) < CHAT_SHARE else code
        s = int(torch.randint(0, len(src) - seq - 1, (), generator=gen))
        rows.append(src[s : s + seq])
    return torch.stack(rows).long()


def train(model, code, chats, sc: dict, minutes: float, steps: int | None, dev) -> dict:
    """AdamW, warmup 5% then cosine to 10%; the step count from `steps` or from the budget after 5 timed steps."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=sc["lr"], betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )
    gen = torch.Generator().manual_seed(SEED)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    budget = minutes * 60
    total = steps or 10**9
    history, t0, t_timed = [], time.perf_counter(), None
    step = 0
    model.train()
    while step < total:
        warm = max(1, math.ceil(0.05 * total)) if total < 10**9 else 10**9
        frac = (step - warm) / max(1, total - warm)
        lr_scale = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        if total == 10**9:
            lr_scale = 0.01  # until the step count is known (the first timed steps): a tiny step, no schedule yet
        for g in opt.param_groups:
            g["lr"] = sc["lr"] * lr_scale
        x = batch_of(code, chats, gen, sc["batch"], sc["seq"]).to(dev)
        with autocast:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_timed = time.perf_counter()
        if step == 6 and steps is None:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per = (time.perf_counter() - t_timed) / 5
            total = max(step + 1, int((budget - (time.perf_counter() - t0)) / per) + step)
            log(f"step time {per * 1000:.0f} ms -> {total} steps in the {minutes} min budget")
        if step % 25 == 0 or step == total or step <= 6:
            history.append(
                {"step": step, "loss": float(loss), "lr": sc["lr"] * lr_scale, "t": time.perf_counter() - t0}
            )
            log(f"step {step}/{total if total < 10**9 else '?'} loss {float(loss.detach()):.4f}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    el = time.perf_counter() - t0
    tokens = step * sc["batch"] * sc["seq"]
    return {"steps": step, "elapsed_s": el, "tokens": tokens, "tokens_per_s": tokens / el, "history": history}


@torch.inference_mode()
def heldout_loss(model, stream: torch.Tensor, n_bytes_per_token: float, seq: int, dev) -> dict:
    model.eval()
    n = len(stream) // (seq + 1)
    tot, cnt = 0.0, 0
    for i in range(0, n, 16):
        rows = [stream[j * (seq + 1) : (j + 1) * (seq + 1)] for j in range(i, min(n, i + 16))]
        x = torch.stack(rows).long().to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        tot += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
        cnt += x[:, 1:].numel()
    loss = tot / max(cnt, 1)
    return {
        "loss": loss,
        "tokens": cnt,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2) / n_bytes_per_token,
    }


def stat_sequences(tok, held_docs: list[str], prompts: list[dict], n: int, seq: int) -> list[list[int]]:
    """Held-out documents from their start (as trained: path comment first) and held-out chat prompts."""
    seqs = [tok(d, add_special_tokens=False)["input_ids"][:seq] for d in held_docs[:n]]
    for p in prompts[:n]:
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)
        seqs.append(ids["input_ids"][:seq])
    return [s for s in seqs if len(s) >= 8]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--root", action="append", type=Path, help="site-packages (default: this Python's)")
    ap.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    ap.add_argument("--minutes", type=float, default=6.0, help="training budget (wall clock of the step loop)")
    ap.add_argument("--deadline-s", type=float, default=None, help="end the training so the whole script ends by then")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (replays a recorded run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    sc, dev, out = SCALES[a.scale], torch.device(a.device), a.out
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    t_all = time.perf_counter()
    roots = a.root or corpus.site_dirs()
    report: dict = {"scale": a.scale, "roots": [str(r) for r in roots], "heldout_packages": list(corpus.HELDOUT)}

    train_files, held_files = corpus.split(roots)
    report["packages"] = {
        "train": len({f.package for f in train_files}),
        "heldout": sorted({f.package for f in held_files}),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
    }
    log(
        f"corpus: {len(train_files)} training files, {len(held_files)} held-out files ({report['packages']['heldout']})"
    )
    t = time.perf_counter()
    chat_stats = chat.build_sets(roots, out / "chat", max_train=sc["max_train_chats"])
    rows = [json.loads(line) for line in (out / "chat" / "train.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (out / "chat" / "heldout_prompts.jsonl").read_text().splitlines()]
    report["chat"] = {k: v for k, v in chat_stats.items()} | {"build_s": time.perf_counter() - t}
    log(
        f"chat data: {len(rows)} train conversations, {len(prompts)} held-out prompts ({time.perf_counter() - t:.0f} s)"
    )

    t = time.perf_counter()
    docs, dstat = documents(train_files, sc["corpus_mb"])
    held_docs, hstat = documents(held_files, 1e9)
    report["corpus"] = {"train": dstat, "heldout": hstat, "read_s": time.perf_counter() - t}
    log(f"read {dstat['bytes'] / 1e6:.0f} MB of training source, {hstat['bytes'] / 1e6:.1f} MB held out")

    t = time.perf_counter()
    tok_texts, size = [], 0
    for d in docs:  # the first tokenizer_mb MB of the (shuffled) training documents, and the chat turns
        tok_texts.append(d)
        size += len(d)
        if size >= sc["tokenizer_mb"] * 1e6:
            break
    tok_texts += [m["content"] for r in rows for m in r["messages"]]
    tok = build_tokenizer(out / "target", tok_texts, sc["vocab"])
    report["tokenizer"] = {"vocab": len(tok), "trained_on_bytes": size, "train_s": time.perf_counter() - t}
    log(f"tokenizer: {len(tok)} tokens ({time.perf_counter() - t:.0f} s)")

    t = time.perf_counter()
    code = token_stream(tok, docs)
    chats = chat_stream(tok, rows)
    held_all = token_stream(tok, held_docs)
    held_bpt = sum(len(d.encode()) + 1 for d in held_docs) / len(held_all)  # bytes per token, held-out text
    held = held_all[: sc["heldout_tokens"] + sc["heldout_tokens"] // sc["seq"] + 1]
    report["tokens"] = {
        "train_code": len(code),
        "train_chat": len(chats),
        "bytes_per_token_train": dstat["bytes"] / len(code),
        "bytes_per_token_heldout": held_bpt,
        "tokenize_s": time.perf_counter() - t,
    }
    log(f"tokens: {len(code):,} code, {len(chats):,} chat; {report['tokens']['bytes_per_token_train']:.2f} B/token")

    model = make_model(tok, sc["model"], dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    report["model"] = {
        **sc["model"],
        "vocab_size": len(tok),
        "layer_types": list(model.config.layer_types),
        "params": n_params,
        "params_non_embedding": n_params - n_embed,
    }
    log(f"model: {n_params / 1e6:.1f}M parameters ({(n_params - n_embed) / 1e6:.1f}M without embeddings)")
    rand_seqs = stat_sequences(tok, held_docs, prompts, sc["stat_seqs"], sc["seq"])
    model.eval()
    report["random_init_stats"] = stats.activation_stats(model, rand_seqs, tok)
    report["random_init_heldout"] = heldout_loss(model, held, held_bpt, sc["seq"], dev)

    minutes = a.minutes
    if a.deadline_s is not None:  # the time after training (held-out loss, statistics, save) is ~30-60 s
        minutes = min(minutes, (a.deadline_s - (time.perf_counter() - t_all) - 60) / 60)
        log(f"training budget {minutes:.2f} min (deadline {a.deadline_s:.0f} s)")
    report["train"] = train(model, code, chats, sc, minutes, a.steps, dev)
    report["recipe"] = {
        "seq": sc["seq"],
        "batch": sc["batch"],
        "lr": sc["lr"],
        "schedule": "AdamW (0.9, 0.95), wd 0.1, clip 1.0, warmup 5%, cosine to 10%",
        "bf16_autocast": dev.type == "cuda",
        "chat_share": CHAT_SHARE,
        "seed": SEED,
    }
    t = time.perf_counter()
    report["heldout"] = heldout_loss(model, held, held_bpt, sc["seq"], dev)
    last = report["train"]["history"][-4:]
    report["train_loss_last"] = sum(h["loss"] for h in last) / len(last)
    log(
        f"held-out loss {report['heldout']['loss']:.4f} ({report['heldout']['bits_per_byte']:.3f} bits/byte); "
        f"train loss (last) {report['train_loss_last']:.4f}"
    )
    model = model.to(torch.bfloat16).eval()  # saved and studied as the pipeline loads it (bf16 on a GPU)
    report["stats"] = stats.activation_stats(model, rand_seqs, tok)
    report["stats_sequences"] = len(rand_seqs)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out / "target")
    (out / "target" / "BUILD_OK").write_text("realtext\n")
    report["eval_save_s"] = time.perf_counter() - t
    report["total_s"] = time.perf_counter() - t_all
    (out / "target_report.json").write_text(json.dumps(report, indent=1, default=str))
    print(stats.table(report["random_init_stats"], "random init (same shape, seed 0):"))
    print(stats.table(report["stats"], "trained:"))
    log(f"done in {report['total_s']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
