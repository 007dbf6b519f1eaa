"""The regenerate stage's output, shared by both backends: the settings record, resume, one line per finished
conversation, the truncation policy, reasoning in the form the prepare stage renders, progress and the summary.

Files, for an output path `X.jsonl`:
- `X.jsonl`: the kept conversations, one JSON line each: {"id", "messages", "regen": {"outcome", "finish",
  "tokens"}} (OpenAI messages form: the prepare stage reads it like any source).
- `X.rejected.jsonl`: conversations not kept: {"id", "outcome", "reason", "regen"} and, for 'quarantined', their
  "messages". outcomes: "dropped" / "quarantined" (a reply cut by max_new_tokens, regenerate.on_truncated) and
  "failed" (the server refused that conversation, e.g. a prompt over the context length).
- `X.run.json`: who wrote the lines: backend, server, model and every setting that changes a reply. A rerun with
  other values refuses to mix them (RegenerateMismatch names each difference).
- `X.lock`: held (flock) by the one process writing the output; a second one stops with an error. The prepare
  stage reads X.jsonl holding a shared flock on it (`reading_regenerated`): it waits for a writer to finish, and
  a writer waits for its readers, so no run prepares (and fingerprints) a file another run is appending to.
- `X.writer.lock`: held by the writer alone, so that a second writer is refused at once while readers only wait.

Commit protocol: a conversation is finished when its line (ending in a newline) is in one of the two files; lines
are appended and flushed one conversation at a time (a killed process loses at most the conversations in flight)
and fsynced at least once a second. At start, a torn last line (a crash mid-write) is cut off and the ids of both
files are skipped, so a rerun continues where the last one stopped, never writes an id twice and never rewrites a
finished line.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

RUN_RECORD_VERSION = 1
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
OUTCOMES = ("ok", "truncated_kept", "dropped", "quarantined", "failed")


class RegenerateError(PipelineError):
    """The regenerate stage cannot run as configured (server unreachable, model not served, key refused, ...)."""


class RegenerateMismatch(RegenerateError):
    """The output was started with another backend, model or settings."""


# ---- one reply --------------------------------------------------------------------------------------------
@dataclass
class Reply:
    """One regenerated assistant turn."""

    content: str
    reasoning: str | None = None
    finish: str = "stop"  # "stop" | "length" (cut by max_new_tokens) | "tool_calls" | what the server said
    tokens: int | None = None  # completion tokens (None: the server did not say)
    tool_calls: list[dict] | None = None
    inline_reasoning: bool = False  # the reasoning was left inside `content` as the target wrote it

    @property
    def truncated(self) -> bool:
        return self.finish == "length"


def split_inline_think(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a reply that writes its reasoning inline, `<think>...</think>answer` (a server
    without a reasoning parser, or the transformers backend). `opened`: the generation prompt itself opened the
    think block (Qwen3.5/3.6, *-Thinking), so the reply starts inside it. A think block cut by max_tokens (no
    `</think>`) is all reasoning. Text without think markup is all content."""
    s = text.lstrip()
    if s.startswith(THINK_OPEN):
        s, opened = s[len(THINK_OPEN) :], True
    if THINK_CLOSE in s:
        head, _, tail = s.partition(THINK_CLOSE)
        return head.strip("\n"), tail.lstrip("\n")
    if opened:
        return s.strip("\n"), ""
    return None, text


def assistant_message(reply: Reply, form: str, original: dict) -> dict:
    """The assistant message for a reply, reasoning in `form` ('field': reasoning_content, 'inline': the Qwen
    rendering `<think>\\n{reasoning}\\n</think>\\n\\n{content}`, which templates without a reasoning field render
    as text). Other keys of the original message (name, ...) are kept; its content, reasoning and tool calls are
    replaced."""
    msg = {k: v for k, v in original.items() if k not in ("content", "reasoning_content", "reasoning", "tool_calls")}
    msg["role"] = "assistant"
    reasoning = reply.reasoning.strip("\n") if reply.reasoning else None
    if reasoning and form == "inline":
        msg["content"] = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{reply.content.lstrip()}"
    else:
        msg["content"] = reply.content
        if reasoning:
            msg["reasoning_content"] = reasoning
    if reply.tool_calls:
        msg["tool_calls"] = reply.tool_calls
    return msg


def turns_to_regenerate(messages: list[dict], turns: str) -> list[int]:
    """Indices of the assistant turns to regenerate, in order. A turn that made tool calls keeps the dataset's
    own (the tool results after it answer exactly those calls); 'last' = only the final assistant turn."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    return idx[-1:] if turns == "last" else idx


def template_reads_reasoning(tokenizer) -> bool:
    """The check the prepare stage makes (dataprep/render.py): does the chat template take reasoning from a field?"""
    t = tokenizer.chat_template
    text = "\n".join(t.values()) if isinstance(t, dict) else (t or "")
    return "reasoning_content" in text or ".reasoning" in text


# ---- the settings record ----------------------------------------------------------------------------------
def settings_record(cfg, *, backend: str, model: str, source: str, fmt: str, split: str, form: str) -> dict:
    """What a reply depends on: a resumed output must have been written with exactly these."""
    return {
        "backend": backend,
        "model": model,
        "source": source,
        "format": fmt,
        "split": split,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "turns": cfg.turns,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "extra_body": cfg.extra_body if backend == "openai" else {},
        "on_truncated": cfg.on_truncated,
        "reasoning_form": form,
    }


# ---- progress ---------------------------------------------------------------------------------------------
@dataclass
class RegenProgress:
    done: int  # finished conversations in the output (kept + rejected), earlier runs included
    total: int  # conversations in the source (after max_samples)
    generated: int  # finished by this run
    failed: int  # this run's conversations the server refused (outcome "failed")
    retries: int  # requests retried by this run (timeouts, connection errors, 429, 5xx)
    new_tokens: int  # this run
    elapsed_s: float
    conversations_per_s: float
    tokens_per_s: float
    eta_s: float | None  # None until a rate is known

    def line(self) -> str:
        eta = "?" if self.eta_s is None else _duration(self.eta_s)
        return (
            f"regenerated {self.done}/{self.total} conversations ({self.generated} now, {self.failed} failed, "
            f"{self.retries} retries), {self.conversations_per_s:.2f} conv/s, {self.tokens_per_s:.0f} tokens/s, "
            f"ETA {eta}"
        )


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ---- the output -------------------------------------------------------------------------------------------
def _scan(path: Path) -> Iterator[dict]:
    """The complete lines of an append-only JSONL, read one at a time (outputs of thinking models run to GBs); a
    torn last line (a crash mid-write) is cut off the file."""
    if not path.exists():
        return
    good = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            good += len(line)
            if line.strip():
                yield json.loads(line)
    size = path.stat().st_size
    if good != size:
        log.warning("%s: cut a torn last line (%d bytes) left by an interrupted run", path, size - good)
        with open(path, "r+b") as f:
            f.truncate(good)


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    turn_tokens: list[int] = field(default_factory=list)  # output tokens of each regenerated turn
    truncated_turns: int = 0
    reasoning_turns: int = 0

    def add(self, outcome: str, regen: dict) -> None:
        self.outcomes[outcome] += 1
        self.turn_tokens += [t for t in regen.get("tokens", []) if t is not None]
        self.truncated_turns += sum(f == "length" for f in regen.get("finish", []))
        self.reasoning_turns += regen.get("reasoning_turns", 0)


def length_stats(tokens: list[int]) -> dict[str, float]:
    if not tokens:
        return {}
    s = sorted(tokens)

    def q(p: float) -> int:
        return s[min(len(s) - 1, int(p * len(s)))]

    return {
        "turns": len(s),
        "mean": round(sum(s) / len(s), 1),
        "min": s[0],
        "p10": q(0.10),
        "p50": q(0.50),
        "p90": q(0.90),
        "p99": q(0.99),
        "max": s[-1],
    }


@contextmanager
def reading_regenerated(path: str | Path) -> Iterator[None]:
    """Hold a shared flock on a regenerated file's `X.lock` while it is read (the prepare stage): a run appending
    to it finishes first, and waits for its readers (see the module doc). Any other source: nothing to hold."""
    p = Path(path)
    lock = p.with_name(p.stem + ".lock")
    if p.suffix != ".jsonl" or not lock.exists():
        yield
        return
    with open(lock, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for the run regenerating into %s to finish before preparing it", p)
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        yield  # closing the file releases the lock


class RegenOutput:
    """The output files of one regeneration (see the module doc). Single writer: the stage's own process."""

    def __init__(self, out_path: str | Path, settings: dict, server: dict | None = None):
        self.path = Path(out_path)
        self.rejected_path = self.path.with_name(self.path.stem + ".rejected.jsonl")
        self.record_path = self.path.with_name(self.path.stem + ".run.json")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = open(self.path.with_name(self.path.stem + ".writer.lock"), "a")
        try:  # one writer: a second run on the same output (a stray retry, two deployments) would interleave lines
            fcntl.flock(self._writer.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._writer.close()
            raise RegenerateError(
                f"another process is regenerating into {self.path} right now; wait for it to finish or stop it"
            ) from None
        self._lock = open(self.path.with_name(self.path.stem + ".lock"), "a")
        try:  # readers (a run preparing the file) finish first: they must not see lines appended half-way
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for the run preparing a dataset from %s to finish reading it", self.path)
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX)
        try:
            self._check_settings(settings, server or {})
            self.earlier = Tally()
            self.done: set[str] = set()
            self.sources: dict[str, str] = {}  # id -> digest of the source row it was made from (recorded since s27)
            self.source_of: dict[str, str] = {}  # the same for the conversations pending now (regenerate sets them)
            n = 0
            for kept, p in ((True, self.path), (False, self.rejected_path)):
                for r in _scan(p):
                    regen = r.get("regen", {})
                    self.earlier.add(regen.get("outcome", "ok") if kept else r["outcome"], regen)
                    self.done.add(r["id"])
                    if isinstance(r.get("source"), str):
                        self.sources[r["id"]] = r["source"]
                    n += 1
            if len(self.done) != n:
                raise RegenerateError(
                    f"{self.path} and {self.rejected_path} hold an id twice: they were edited or written by two runs "
                    "at once; move them away and regenerate afresh"
                )
        except BaseException:
            self._lock.close()
            self._writer.close()
            raise
        self.now = Tally()
        self._files = {"kept": open(self.path, "a", encoding="utf-8"), "rejected": None}
        self._last_sync = time.monotonic()

    def _check_settings(self, settings: dict, server: dict) -> None:
        has_lines = any(p.exists() and p.stat().st_size for p in (self.path, self.rejected_path))
        if self.record_path.exists():
            old = json.loads(self.record_path.read_text())
            diff = {k: (old["settings"].get(k), v) for k, v in settings.items() if old["settings"].get(k) != v}
            if diff and has_lines:
                what = "; ".join(f"{k}: {a!r} before, {b!r} now" for k, (a, b) in diff.items())
                raise RegenerateMismatch(
                    f"{self.path} was started with other settings ({what}): its replies would be mixed with "
                    "these. Set the old values back to continue it, or use another output_dir (or move "
                    f"{self.path}, {self.rejected_path.name} and {self.record_path.name} away) to start afresh"
                )
        elif has_lines:
            raise RegenerateMismatch(
                f"{self.path} has no settings record ({self.record_path.name}): it was written by an older version "
                "or another tool, so this run cannot tell whether its replies match. Move it away to start afresh"
            )
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {"version": RUN_RECORD_VERSION, "settings": settings, "server": server, "written": time.time()},
                indent=1,
            )
            + "\n"
        )
        os.replace(tmp, self.record_path)

    def key_for(self, key: str, source: str) -> str | None:
        """The key to regenerate the source row `key` under, whose content digest is `source`; None when it is done.
        A row edited since its conversation was made (same id, another digest) is regenerated under
        `key@digest`: the nightly run's "changed rows are extracted again" (a damage check saw an edited row skipped
        by id). A record from before digests were recorded counts as done."""
        if key not in self.done:
            return key
        if self.sources.get(key, source) == source:
            return None
        changed = f"{key}@{source[:12]}"
        return None if changed in self.done else changed

    def commit(self, key: str, messages: list[dict], replies: list[Reply], on_truncated: str, error: str = "") -> str:
        """Write one finished conversation; returns its outcome."""
        regen: dict[str, Any] = {
            "finish": [r.finish for r in replies],
            "tokens": [r.tokens for r in replies],
        }
        n_reason = sum(bool(r.reasoning) or r.inline_reasoning for r in replies)
        if n_reason:
            regen["reasoning_turns"] = n_reason
        truncated = any(r.truncated for r in replies)
        if error:
            outcome, row = "failed", {"id": key, "outcome": "failed", "reason": error, "regen": regen}
        elif truncated and on_truncated != "keep":
            outcome = "dropped" if on_truncated == "drop" else "quarantined"
            row = {"id": key, "outcome": outcome, "reason": "a reply was cut by max_new_tokens", "regen": regen}
            if outcome == "quarantined":
                row["messages"] = messages
        else:
            outcome = "truncated_kept" if truncated else "ok"
            row = {"id": key, "messages": messages, "regen": {"outcome": outcome, **regen}}
        if key in self.source_of:
            row["source"] = self.sources[key] = self.source_of.pop(key)
        where = "kept" if outcome in ("ok", "truncated_kept") else "rejected"
        if self._files[where] is None:
            self._files[where] = open(self.rejected_path, "a", encoding="utf-8")
        f = self._files[where]
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()  # in the OS: survives the process being killed
        self.done.add(key)
        self.now.add(outcome, regen)
        if time.monotonic() - self._last_sync > 1.0:
            self.sync()
        return outcome

    def sync(self) -> None:
        for f in self._files.values():
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
        self._last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()
        for f in self._files.values():
            if f is not None:
                f.close()
        self._lock.close()  # releases the locks
        self._writer.close()


class ProgressMeter:
    """Rates and ETA for the progress callback, reported at most every `every_s` seconds (and at the end)."""

    def __init__(self, out: RegenOutput, total: int, callback: Callable[[RegenProgress], None] | None, every_s=2.0):
        self.out, self.total, self.callback, self.every_s = out, total, callback, every_s
        self.t0 = time.perf_counter()
        self.start_done = len(out.done)
        self.retries = 0
        self._last = 0.0

    def snapshot(self) -> RegenProgress:
        el = time.perf_counter() - self.t0
        gen = len(self.out.done) - self.start_done
        ntok = sum(self.out.now.turn_tokens)
        cps = gen / el if el > 0 else 0.0
        left = max(self.total - len(self.out.done), 0)
        return RegenProgress(
            done=len(self.out.done),
            total=self.total,
            generated=gen,
            failed=self.out.now.outcomes["failed"],
            retries=self.retries,
            new_tokens=ntok,
            elapsed_s=el,
            conversations_per_s=cps,
            tokens_per_s=ntok / el if el > 0 else 0.0,
            eta_s=(left / cps) if cps > 0 else (0.0 if left == 0 else None),
        )

    def tick(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        p = self.snapshot()
        log.info("%s", p.line())
        if self.callback is not None:
            self.callback(p)


def summary(out: RegenOutput) -> dict:
    """Counts by outcome and the output-length distribution, over the whole output (earlier runs included)."""
    outcomes = {k: out.earlier.outcomes[k] + out.now.outcomes[k] for k in OUTCOMES}
    return {
        "outcomes": outcomes,
        "outcomes_this_run": {k: out.now.outcomes[k] for k in OUTCOMES},
        "turn_tokens": length_stats(out.earlier.turn_tokens + out.now.turn_tokens),
        "reasoning_turns": out.earlier.reasoning_turns + out.now.reasoning_turns,
    }
