"""Regenerate the assistant turns of a chat dataset with the target itself (optional stage before extraction).

A drafter imitates whatever text it is trained on; serving verifies it against the target's own outputs, so
training on the target's responses (greedy or ~0.7 temperature) gives far higher acceptance than the dataset's
original responses (docs/ARCHITECTURE.md, "Field facts"). Turns are regenerated in order: with turns='all' each
assistant turn is generated given the already regenerated history.

Two backends write the same output (drafter/regen_output.py: files, resume, truncation policy, reasoning form):
- `transformers` (drafter/regen_hf.py): batched `generate` in this process, for the embedded default and small runs;
- `openai` (drafter/regen_openai.py): an OpenAI-compatible server (vLLM, SGLang) serving the target, with bounded
  concurrency and retries, for real scale.

Output: a JSONL of {"id", "messages", "regen"} that the prepare stage reads like any source; conversations not kept
(truncation policy, refused by the server) go to `<name>.rejected.jsonl`; `<name>.run.json` records the backend,
server, model and settings, and a rerun with others refuses to mix them. The stage is resumable: a rerun skips the
conversations already in either file, by id and a digest of the source row each was made from (`source`): a row
edited since is made again, under `id@digest`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_pipeline.drafter.config import RegenerateConfig
from dflash_pipeline.drafter.regen_output import (
    ProgressMeter,
    RegenOutput,
    RegenProgress,
    settings_record,
    summary,
    template_reads_reasoning,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from dflash_pipeline.extraction.probe import ProbeReport

__all__ = ["RegenProgress", "RegenerateResult", "regenerate"]


@dataclass
class RegenerateResult:
    path: str
    conversations: int  # kept conversations in the output file now (earlier runs included)
    generated: int  # conversations finished by this call (any outcome)
    skipped_rows: int  # unusable source rows (the prepare stage reports them)
    truncated_turns: int  # turns of this call cut by max_new_tokens before the end of the reply
    new_tokens: int
    elapsed_s: float
    backend: str = "transformers"
    model: str = ""
    total: int = 0  # usable conversations in the source (after max_samples)
    failed: int = 0  # this call's conversations the server refused (outcome "failed")
    retries: int = 0  # requests retried by this call
    rejected_path: str = ""
    outcomes: dict[str, int] = field(default_factory=dict)  # whole output, by outcome
    outcomes_this_run: dict[str, int] = field(default_factory=dict)
    turn_tokens: dict[str, float] = field(default_factory=dict)  # output-length distribution per regenerated turn
    reasoning_turns: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _conversations(
    source: str, fmt: str, split: str, max_samples: int | None
) -> Iterator[tuple[str, list, Any] | None]:
    """(key, messages, tools) per usable row, None per unusable one. The key is the row's id (else row-N); an id
    seen before in the source gets the row number appended, so every conversation has its own key."""
    from dflash_pipeline.dataprep.normalize import RowError, normalize_conversation
    from dflash_pipeline.dataprep.sources import BadLine, iter_rows

    n, seen = 0, set()
    for row_no, row in iter_rows(source, split):
        if max_samples is not None and n >= max_samples:
            return
        if isinstance(row, BadLine):
            yield None
            continue
        try:
            conv = normalize_conversation(row, fmt)
        except RowError:
            yield None
            continue
        n += 1
        rid = row.get("id") if isinstance(row, dict) and isinstance(row.get("id"), (str, int)) else None
        key = str(rid) if rid is not None else f"row-{row_no}"
        if key in seen:
            key = f"{key}@row-{row_no}"
        seen.add(key)
        yield key, conv.messages, conv.tools


def _pending(conversations, out: RegenOutput) -> Iterator[tuple[str, list, Any]]:
    """The conversations `out` has not made yet: rows never regenerated, and rows edited since (another key)."""
    import xxhash

    for c in conversations:
        if c is None:
            continue
        key, messages, tools = c
        digest = xxhash.xxh3_128(json.dumps([messages, tools], sort_keys=True, ensure_ascii=False).encode()).hexdigest()
        if (k := out.key_for(key, digest)) is not None:
            if k != key:
                log.info("source row %s changed since it was regenerated: regenerating it again, as %s", key, k)
            out.source_of[k] = digest
            yield k, messages, tools


def _prompt_opens_think(tok, kwargs: dict) -> bool:
    """Does the generation prompt itself open a think block (Qwen3.5/3.6, *-Thinking checkpoints)?"""
    try:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception:  # noqa: BLE001 - a template that cannot render this probe simply does not open one
        return False
    return prompt.rstrip().endswith("<think>")


def regenerate(
    source: str,
    out_path: str | Path,
    report: ProbeReport,
    cfg: RegenerateConfig,
    *,
    fmt: str = "auto",
    split: str = "train",
    max_samples: int | None = None,
    progress: Callable[[RegenProgress], None] | None = None,
) -> RegenerateResult:
    """Regenerate assistant turns of `source` into `out_path` (resumable), with cfg.backend."""
    from dflash_pipeline.extraction.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    form = cfg.reasoning_form
    if form == "auto":  # the form the prepare stage renders with this target's template
        form = "field" if template_reads_reasoning(tok) else "inline"
    opens_think = _prompt_opens_think(tok, cfg.chat_template_kwargs)
    if cfg.backend == "openai":
        from dflash_pipeline.drafter.regen_openai import check_server

        server = check_server(cfg)
        model = server["model"]
    else:
        server, model = {}, report.model_path
    settings = settings_record(cfg, backend=cfg.backend, model=model, source=source, fmt=fmt, split=split, form=form)
    if server.get("card", {}).get("root"):  # vLLM names the weights behind a served name: compare those too
        settings["model_root"] = server["card"]["root"]
    total = skipped = 0
    for item in _conversations(source, fmt, split, max_samples):
        total += item is not None
        skipped += item is None
    out = RegenOutput(out_path, settings, server)
    meter = ProgressMeter(out, total, progress)
    pending = _pending(_conversations(source, fmt, split, max_samples), out)
    log.info(
        "regenerate (%s, %s): %d conversations, %d already done, reasoning stored %s",
        cfg.backend,
        model,
        total,
        len(out.done),
        "in reasoning_content" if form == "field" else "inline (<think> in content)",
    )
    try:
        if cfg.backend == "openai":
            from dflash_pipeline.drafter.regen_openai import run_openai

            run_openai(cfg, model, pending, out, meter, form, opens_think)
        else:
            from dflash_pipeline.drafter.regen_hf import run_transformers

            run_transformers(report, cfg, pending, out, meter, form, opens_think, tok)
    finally:
        out.close()
        meter.tick(force=True)
    p, s = meter.snapshot(), summary(out)
    res = RegenerateResult(
        path=str(out.path),
        conversations=s["outcomes"]["ok"] + s["outcomes"]["truncated_kept"],
        generated=p.generated,
        skipped_rows=skipped,
        truncated_turns=out.now.truncated_turns,
        new_tokens=p.new_tokens,
        elapsed_s=time.perf_counter() - t0,
        backend=cfg.backend,
        model=model,
        total=total,
        failed=p.failed,
        retries=p.retries,
        rejected_path=str(out.rejected_path),
        outcomes=s["outcomes"],
        outcomes_this_run=s["outcomes_this_run"],
        turn_tokens=s["turn_tokens"],
        reasoning_turns=s["reasoning_turns"],
    )
    log.info(
        "regenerated %d conversations (%d new tokens, %d truncated turns); output: %s",
        res.generated,
        res.new_tokens,
        res.truncated_turns,
        res.outcomes,
    )
    return res
