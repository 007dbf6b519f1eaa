"""Acceptance length of a drafter with the real target: greedy speculative decoding on held-out prompts.

Per verification step: the drafter proposes block_size-1 tokens after the last accepted token (the
anchor), from the target's hidden states of every position before the anchor; the target runs once on
[context ; anchor ; drafts]; the longest prefix of drafts equal to the target's greedy choices is
accepted, plus the target's own next token (the bonus). Acceptance length tau = mean tokens produced
per verification step (accepted + bonus, as in the DFlash paper), so 1 <= tau <= block_size.

Correctness over speed: every step re-runs the target over the whole sequence (no KV cache), which is
exact for any architecture (hybrid GDN included). The output is the target's own greedy continuation,
and `lossless_check` compares it against plain greedy decoding.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_pipeline.drafter.config import EvalConfig
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.target_head import head_from_model
from dflash_pipeline.extraction.capture import LayerCapture

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from dflash_pipeline.extraction.probe import ProbeReport


@dataclass
class AcceptanceReport:
    acceptance_length: float
    block_size: int
    num_prompts: int
    verify_steps: int
    generated_tokens: int
    position_accept_rate: list[float]  # [k-1]: share of steps whose draft position k was accepted
    per_prompt: list[dict] = field(default_factory=list)
    untrained_acceptance_length: float | None = None  # same spec, freshly initialized: the baseline

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self, title: str = "Drafter acceptance") -> str:
        rates = " | ".join(f"{r:.2f}" for r in self.position_accept_rate)
        heads = " | ".join(str(k) for k in range(1, len(self.position_accept_rate) + 1))
        return (
            f"# {title}\n\n**Acceptance length: {self.acceptance_length:.3f}** tokens per target step "
            f"(greedy; block size {self.block_size}; range 1..{self.block_size})\n\n"
            + (
                f"- untrained drafter (baseline): {self.untrained_acceptance_length:.3f}\n"
                if self.untrained_acceptance_length is not None
                else ""
            )
            + f"- prompts: {self.num_prompts}, verification steps: {self.verify_steps}, "
            f"generated tokens: {self.generated_tokens}\n\n"
            f"Acceptance rate by draft position (share of steps that accepted position k):\n\n"
            f"| k | {heads} |\n|---|{'---|' * len(self.position_accept_rate)}\n| rate | {rates} |\n"
        )


@torch.inference_mode()
def speculative_generate(
    target, drafter: DFlashDrafter, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding; returns (generated tokens, tokens produced per verification step)."""
    s, dev = drafter.spec, next(drafter.parameters()).device
    head = head_from_model(target)
    capture = LayerCapture(target, s.target_layer_ids)  # the same layer values extraction stored
    seq = torch.tensor([prompt_ids], device=dev)
    with capture.recording(stop=False) as outs:
        out = target(input_ids=seq, use_cache=False)
    feats = capture.features(outs)
    gen = [int(out.logits[0, -1].argmax())]
    produced: list[int] = []
    while len(gen) < max_new_tokens and gen[-1] not in stop_ids:
        seq = torch.tensor([prompt_ids + gen], device=dev)
        ctx_len = seq.shape[1] - 1  # the anchor (last token) has no target hidden state yet
        block = torch.full((1, s.block_size), s.mask_token_id, device=dev)
        block[0, 0] = gen[-1]
        bpos = torch.arange(ctx_len, ctx_len + s.block_size, device=dev)[None]
        masks = drafter.block_masks(torch.tensor([[ctx_len]], device=dev), None, ctx_len)
        h = drafter(
            feats[:, :ctx_len].to(next(drafter.parameters()).dtype),
            head.embed(block).to(feats.dtype),
            torch.arange(ctx_len, device=dev)[None],
            bpos,
            masks,
        )
        drafts = head.logits(h[0, 1:].to(head.lm_head.weight.dtype)).argmax(-1)
        with capture.recording(stop=False) as outs:
            out = target(input_ids=torch.cat([seq, drafts[None]], dim=1), use_cache=False)
        greedy = out.logits[0, ctx_len:].argmax(-1)  # greedy[j] = target's token after block position j
        n_acc = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        new = drafts[:n_acc].tolist() + [int(greedy[n_acc])]
        budget = max_new_tokens - len(gen)
        new = new[:budget]
        for j, t in enumerate(new):  # stop at the first stop token
            if t in stop_ids:
                new = new[: j + 1]
                break
        gen += new
        produced.append(len(new))
        feats = capture.features(outs)[:, : ctx_len + 1 + n_acc]
    return gen, produced


@torch.inference_mode()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding with full recomputation (the reference for the lossless check)."""
    dev = next(target.parameters()).device
    gen: list[int] = []
    while len(gen) < max_new_tokens and (not gen or gen[-1] not in stop_ids):
        logits = target(input_ids=torch.tensor([prompt_ids + gen], device=dev), use_cache=False).logits
        gen.append(int(logits[0, -1].argmax()))
    return gen


def load_prompts(cfg: EvalConfig) -> list[dict]:
    path = cfg.prompts
    if path == "embedded":
        from dflash_pipeline.embedded import heldout_prompts

        path = str(heldout_prompts())
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[: cfg.num_prompts] if cfg.num_prompts else rows


def evaluate_acceptance(
    drafter: DFlashDrafter,
    target,
    tokenizer,
    cfg: EvalConfig,
    prompts: list[dict] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> AcceptanceReport:
    """Acceptance length over the prompts (target and drafter already on the same device, eval mode)."""
    prompts = prompts if prompts is not None else load_prompts(cfg)
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    stop = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
    bs = drafter.spec.block_size
    all_steps: list[int] = []
    per_prompt = []
    for n_done, p in enumerate(prompts):
        if progress:
            progress(n_done, len(prompts))
        ids = tokenizer.apply_chat_template(
            p["messages"], add_generation_prompt=True, tokenize=True, return_dict=True, **cfg.chat_template_kwargs
        )["input_ids"]
        gen, produced = speculative_generate(target, drafter, list(ids), cfg.max_new_tokens, stop)
        all_steps += produced
        per_prompt.append(
            {
                "id": p.get("id"),
                "tokens": len(gen),
                "steps": len(produced),
                "acceptance_length": sum(produced) / len(produced) if produced else None,
            }
        )
    n = len(all_steps)
    rates = [sum(1 for x in all_steps if x - 1 >= k) / n if n else 0.0 for k in range(1, bs)]
    return AcceptanceReport(
        acceptance_length=sum(all_steps) / n if n else 1.0,
        block_size=bs,
        num_prompts=len(prompts),
        verify_steps=n,
        generated_tokens=sum(all_steps),
        position_accept_rate=rates,
        per_prompt=per_prompt,
    )


def evaluate_export(
    export_dir: str, report: ProbeReport, cfg: EvalConfig, baseline: bool = True, seed: int = 0
) -> AcceptanceReport:
    """Load the exported drafter and the target, evaluate (and, with `baseline`, an untrained drafter of
    the same architecture), and store the result in the export's dflash_meta.json."""
    from dflash_pipeline.drafter.export import load_drafter, update_meta
    from dflash_pipeline.drafter.runtime import resolve_device
    from dflash_pipeline.extraction.loader import load_planned
    from dflash_pipeline.extraction.tokenizer import load_tokenizer

    device = str(resolve_device(cfg.device))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = load_planned(report, device, str(dtype).removeprefix("torch."))  # the extraction's loader
    tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    drafter = load_drafter(export_dir, device, dtype)
    rep = evaluate_acceptance(drafter, target, tok, cfg, progress=_progress_log("trained drafter"))
    if baseline:
        torch.manual_seed(seed)
        fresh = DFlashDrafter(drafter.spec).to(device=device, dtype=dtype).eval()
        untrained = evaluate_acceptance(fresh, target, tok, cfg, progress=_progress_log("untrained baseline"))
        rep.untrained_acceptance_length = untrained.acceptance_length
    update_meta(export_dir, acceptance=rep.to_dict())
    return rep


def _progress_log(what: str, every_s: float = 10.0) -> Callable[[int, int], None]:
    """A log line per prompt, at most one each `every_s` (and the first), with the rate so far: the UI shows that
    evaluation is alive (it takes minutes on CPU)."""
    t0 = time.monotonic()
    last = [-every_s]

    def progress(done: int, total: int) -> None:
        now = time.monotonic() - t0
        if now - last[0] >= every_s or done == 0:
            last[0] = now
            eta = f", ETA {now / done * (total - done):.0f} s" if done else ""
            log.info("evaluate (%s): prompt %d/%d, %.0f s%s", what, done + 1, total, now, eta)

    return progress
