"""The regenerate stage's transformers backend: batched `generate` in this process (the embedded default and small
runs). Output, resume and the truncation policy are drafter/regen_output.py's, shared with the server backend."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from dflash_pipeline.drafter.config import RegenerateConfig
from dflash_pipeline.drafter.regen_output import (
    ProgressMeter,
    RegenOutput,
    Reply,
    assistant_message,
    split_inline_think,
    turns_to_regenerate,
)

if TYPE_CHECKING:
    from dflash_pipeline.extraction.probe import ProbeReport

log = logging.getLogger(__name__)


@torch.inference_mode()
def _generate(model, tok, prompts: list[list[dict]], cfg: RegenerateConfig, stop: set[int]) -> list[Reply]:
    enc = tok.apply_chat_template(
        prompts,
        add_generation_prompt=True,
        tokenize=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
        **cfg.chat_template_kwargs,
    )
    enc = {k: v.to(model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    kw = (
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
        if cfg.temperature > 0
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    )
    out = model.generate(
        **enc, max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=sorted(stop), **kw
    )
    replies = []
    for ids in out[:, enc["input_ids"].shape[1] :].tolist():
        cut = next((i for i, t in enumerate(ids) if t in stop), None)
        ids = ids if cut is None else ids[:cut]
        # Keep special tokens: the ids are cut before the first stop token (so no end-of-turn or padding
        # remains), and what is left, e.g. <think> ... </think>, is the target's own output. Skipping them
        # trained the drafter on text the target never emits (every later token shifted by one).
        text = tok.decode(ids, skip_special_tokens=False).strip()
        replies.append(
            Reply(content=text, finish="length" if cut is None else "stop", tokens=len(ids) + (cut is not None))
        )
    return replies


def run_transformers(
    report: ProbeReport,
    cfg: RegenerateConfig,
    pending: Iterator[tuple[str, list[dict], list | None]],
    out: RegenOutput,
    meter: ProgressMeter,
    form: str,
    prompt_opens_think: bool,
    tok,
) -> None:
    """Generate `pending` conversations (key, messages, tools) batch by batch and commit each to `out`. Tool
    definitions are not passed to the template here (the batch shares one call)."""
    from dflash_pipeline.drafter.runtime import resolve_device
    from dflash_pipeline.extraction.loader import load_planned

    device = resolve_device(cfg.device)
    model = load_planned(report, str(device), "bfloat16" if device.type == "cuda" else "float32")
    tok.padding_side = "left"
    eos = model.generation_config.eos_token_id
    stop = {tok.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
    batch: list[tuple[str, list[dict], list | None]] = []
    n_batches = 0

    def flush() -> None:
        nonlocal n_batches
        torch.manual_seed((cfg.seed or 0) + n_batches)
        n_batches += 1
        convs = [[dict(m) for m in msgs] for _, msgs, _ in batch]
        turns = [turns_to_regenerate(c, cfg.turns) for c in convs]
        got: list[list[Reply]] = [[] for _ in convs]
        for k in range(max((len(t) for t in turns), default=0)):
            todo = [(j, t[k]) for j, t in enumerate(turns) if k < len(t)]
            replies = _generate(model, tok, [convs[j][:i] for j, i in todo], cfg, stop)
            for (j, i), r in zip(todo, replies):
                reasoning, content = split_inline_think(r.content, prompt_opens_think)
                if form == "field" or prompt_opens_think:
                    r.reasoning, r.content = reasoning, content
                else:  # inline, as the target wrote it (byte for byte)
                    r.inline_reasoning = reasoning is not None
                convs[j][i] = assistant_message(r, form, convs[j][i])
                got[j].append(r)
        for (key, _, _), c, rs in zip(batch, convs, got):
            out.commit(key, c, rs, cfg.on_truncated)
        out.sync()
        batch.clear()
        meter.tick()

    for item in pending:
        batch.append(item)
        if len(batch) == cfg.batch_size:
            flush()
    if batch:
        flush()
