"""One progress display for a run: stages report here, a display renders (no Prefect in this module).

`run_pipeline` opens a `Run` with the stages it will run, in order, and each stage in a `with run.stage(name)`
block; the stage's own progress callbacks call `update(name, done, total, unit)` from any thread (the extraction
workers' reader threads, training, regeneration). What a display shows:

- a line when a stage starts and one when it ends: `[3/8] prepare ...` / `[3/8] prepare: 256 samples ... (1.5 s)`
- on a terminal, a live bar for a stage that reports counts (rich, as transformers and datasets users know them);
  not on a terminal, a single line at a quarter, a half and three quarters of the stage, at most every
  LINE_EVERY_S seconds (so a long stage prints at most three lines between its start and end)

Without a display (a deployment's flow run), the stage lines are log records of the `dflash_pipeline.progress`
logger: the Prefect UI gets them like every other record of the package. The CLI's console handler
(`ConsoleHandler`) drops those records (its display already printed them), prints warnings and errors as one
line each, and the INFO records of the libraries and Prefect only with `--verbose`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, TextIO

LOGGER = "dflash_pipeline.progress"
log = logging.getLogger(LOGGER)
LINE_EVERY_S = 5.0  # not on a terminal: at least this long between two progress lines of one stage
MARKS = (0.25, 0.5, 0.75)  # ... and only when the stage passes one of these fractions


@dataclass
class Stage:
    index: int
    count: int
    name: str
    what: str = ""
    started: float = field(default_factory=time.monotonic)
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)  # part -> (done, total)
    unit: str = ""
    first: tuple[float, float] | None = None  # (time, done) of the first update: the rate excludes resumed work
    result: str = ""  # the end line's text, set by the stage (`said`)
    reused: list[str] = field(default_factory=list)  # what of an earlier run this stage reused (`said`)

    def said(self, *results) -> None:
        """The end line and the reuse of this stage, from its typed results (SAID, REUSED below)."""
        self.result = SAID[self.name](*results) if self.name in SAID else str(results[0])
        got = REUSED[self.name](*results) if self.name in REUSED else []
        self.reused = [r for r in ([got] if isinstance(got, str) else got) if r]

    @property
    def label(self) -> str:
        return f"[{self.index}/{self.count}] {self.name}"

    @property
    def done(self) -> float:
        return sum(d for d, _ in self.parts.values())

    @property
    def total(self) -> float:
        return sum(t for _, t in self.parts.values())

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def rate(self) -> float | None:
        if self.first is None:
            return None
        dt = time.monotonic() - self.first[0]
        return (self.done - self.first[1]) / dt if dt > 0.5 else None

    def eta(self) -> float | None:
        r = self.rate()
        return (self.total - self.done) / r if r else None

    def progress_line(self) -> str:
        pct = 100 * self.done / self.total if self.total else 0.0
        r, eta = self.rate(), self.eta()
        rate = f", {r:,.1f} {self.unit}/s" if r else ""
        left = f", ETA {fmt_s(eta)}" if eta is not None else ""
        return f"{self.label}: {self.done:,.0f}/{self.total:,.0f} {self.unit} ({pct:.0f}%){rate}{left}"

    def end_line(self) -> str:
        return f"{self.label}: {self.result or 'done'} ({fmt_s(self.elapsed)})"


def fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {int(s % 60):02d} s"


def counted(n: int, noun: str) -> str:
    """'1 unit', '3 units' (nouns whose plural adds an s)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def short(v: object) -> str:
    """A value as JSON for a message, cut to 60 characters."""
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def shown(path: str | os.PathLike | None) -> str:
    """A path as people read it on the console: relative to the working directory when it lies inside it (a run
    resolves its paths to absolute ones once), else as it is; a URL (s3://) as it is."""
    text = str(path)
    if "://" in text or not os.path.isabs(text):
        return text
    rel = os.path.relpath(text)
    return text if rel == ".." or rel.startswith(".." + os.sep) else rel


class Display(Protocol):
    def started(self, st: Stage) -> None: ...
    def advanced(self, st: Stage) -> None: ...
    def finished(self, st: Stage, ok: bool) -> None: ...
    def message(self, text: str) -> None: ...
    def close(self) -> None: ...


_lock = threading.RLock()
_display: Display | None = None
_active: dict[str, Stage] = {}


@contextlib.contextmanager
def showing(display: Display) -> Iterator[Display]:
    """Render this process's stages with `display` inside the block."""
    global _display
    with _lock:
        previous, _display = _display, display
    try:
        yield display
    finally:
        with _lock:
            _display = previous
        display.close()


def message(text: str) -> bool:
    """Print `text` through the display (above a live bar); False when there is none."""
    with _lock:
        if _display is None:
            return False
        _display.message(text)
        return True


class Run:
    """The stages one run goes through, in order: `with run.stage(name) as st: ...; st.result = '...'`."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.started = time.monotonic()
        self.reused: list[str] = []  # what the stages reused of earlier runs, in order (RunSummary.reused)

    @contextlib.contextmanager
    def stage(self, name: str, what: str = "") -> Iterator[Stage]:
        index = self.names.index(name) + 1 if name in self.names else len(self.names)
        st = Stage(index, len(self.names), name, what)
        with _lock:
            _active[name] = st
            if _display is not None:
                _display.started(st)
        log.info("%s started%s", st.label, f": {what}" if what else "")
        ok = False
        try:
            yield st
            ok = True
        finally:
            with _lock:
                _active.pop(name, None)
                if _display is not None:
                    _display.finished(st, ok)
            if ok:
                log.info("%s", st.end_line())
                self.reused.extend(st.reused)


def update(name: str, done: float, total: float, unit: str = "", part: str = "") -> None:
    """Progress of the running stage `name` (of its `part`, e.g. one extraction worker); nothing when that stage
    is not running in a Run of this process."""
    with _lock:
        st = _active.get(name)
        if st is None:
            return
        st.parts[part] = (float(done), float(total))
        st.unit = unit or st.unit
        if st.first is None:
            st.first = (time.monotonic(), st.done)
        if _display is not None:
            _display.advanced(st)


# ---- displays -----------------------------------------------------------------------------------------------
class LineDisplay:
    """Not on a terminal: plain lines (a CI log, a file, a pipe)."""

    def __init__(self, stream: TextIO | None = None, every_s: float = LINE_EVERY_S):
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}  # stage -> (time of its last line, marks passed)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def started(self, st: Stage) -> None:
        self._last[st.name] = (time.monotonic(), 0)
        self._print(f"{st.label} ...{f' {st.what}' if st.what else ''}")

    def advanced(self, st: Stage) -> None:
        if not st.total or st.done >= st.total:
            return
        at, passed = self._last.get(st.name, (0.0, 0))
        marks = sum(st.done / st.total >= m for m in MARKS)
        if marks > passed and time.monotonic() - at >= self.every_s:
            self._last[st.name] = (time.monotonic(), marks)
            self._print(st.progress_line())

    def finished(self, st: Stage, ok: bool) -> None:
        self._last.pop(st.name, None)
        if ok:
            self._print(st.end_line())

    def message(self, text: str) -> None:
        self._print(text)

    def close(self) -> None:
        pass


class BarDisplay:
    """On a terminal: the running stage as a live rich bar, replaced by its end line when it ends."""

    def __init__(self, stream: TextIO | None = None):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        self.console = Console(file=stream or sys.stderr)
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
            refresh_per_second=4,  # gentle on a busy machine
        )
        self._tasks: dict[str, int] = {}
        self.bars.start()

    def started(self, st: Stage) -> None:
        self._tasks[st.name] = self.bars.add_task(f"{st.label} {st.what}".rstrip(), total=None, rate="")

    def advanced(self, st: Stage) -> None:
        task = self._tasks.get(st.name)
        if task is not None:
            r = st.rate()
            rate = f"{r:,.1f} {st.unit}/s" if r else st.unit
            self.bars.update(task, completed=st.done, total=st.total or None, rate=rate)

    def finished(self, st: Stage, ok: bool) -> None:
        task = self._tasks.pop(st.name, None)
        if task is not None:
            self.bars.remove_task(task)
        if ok:
            self.console.print(st.end_line(), markup=False, highlight=False)

    def message(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self.bars.stop()


def display_for(stream: TextIO | None = None) -> Display:
    stream = stream or sys.stderr
    return BarDisplay(stream) if stream.isatty() else LineDisplay(stream)


# ---- the console's log records --------------------------------------------------------------------------------
GPU_KERNEL_NOTE = "falling back to its reference PyTorch implementation"  # transformers, once per kernel


class CpuOnlyNotes(logging.Filter):
    """Drops transformers' notes that a GPU kernel package is missing when no GPU is visible (they cannot apply)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if GPU_KERNEL_NOTE not in record.getMessage():
            return True
        import torch

        return torch.cuda.is_available()


def hide_gpu_notes_without_gpu() -> None:
    """On the loggers that print those notes (transformers prints through handlers of its own)."""
    lg = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, CpuOnlyNotes) for f in lg.filters):
        lg.addFilter(CpuOnlyNotes())


class ConsoleHandler(logging.Handler):
    """The CLI's console: warnings and errors as one line each (through the display, above a live bar); INFO only
    when `verbose`; never the stage lines (the display printed them)."""

    def __init__(self, verbose: bool = False, stream: TextIO | None = None):
        super().__init__(logging.DEBUG if verbose else logging.WARNING)
        self.verbose = verbose
        self.stream = stream
        self.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            if verbose
            else logging.Formatter("%(levelname)s: %(message)s")
        )

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == LOGGER:
            return
        try:
            text = self.format(record)
            if not self.verbose:
                text = text.replace("WARNING: ", "warning: ", 1).replace("ERROR: ", "error: ", 1)
            if not message(text):
                print(text, file=self.stream or sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging must never fail the run
            self.handleError(record)


def tee(name: str, callback, counts, unit: str, part: str = ""):
    """A stage's progress callback that also reports `counts(*args) -> (done, total)` to the display."""

    def both(*args):
        done, total = counts(*args)
        update(name, done, total, unit, part)
        if callback is not None:
            callback(*args)

    return both


# ---- the stages a run shows, and what each says at its end --------------------------------------------------
def stage_names(cfg) -> list[str]:
    """The display's stages of a run of `cfg` (a RunConfig), in the order run_pipeline runs them."""
    s = set(cfg.stages)
    names = ["probe"]
    names += ["regenerate"] if "regenerate" in s or cfg.regenerate.enabled else []
    names += ["prepare"] if s & {"prepare", "extract", "validate"} else []
    names += ["plan", "extract"] if "extract" in s else []
    names += ["validate"] if "validate" in s else []
    names += ["train"] if "train" in s else []
    names += ["retain"] if "train" in s and cfg.retention.mode != "keep" else []
    names += ["evaluate"] if "evaluate" in s else []
    return names


def said_probe(r) -> str:
    where = ", ".join(sorted(set(r.replicas)))
    q = r.quantization
    forward = ""
    if q:  # an FP8 checkpoint: which of its forwards runs (the store records the same)
        forward = f", FP8 forward ({q['fp8_matmul']})" if q["forward"] == "fp8" else ", FP8 checkpoint dequantized"
    return (
        f"{r.num_layers} layers, hidden {r.hidden_size}, capturing layers {r.layer_ids}, {r.compute_dtype} on {where}"
        f"{forward}"
    )


def said_regenerate(r) -> str:
    if not r.generated:
        return f"reused: all {r.conversations:,} conversations were regenerated before ({r.path})"
    rate = r.new_tokens / r.elapsed_s if r.elapsed_s else 0.0
    return (
        f"{r.generated:,} conversations regenerated ({r.conversations:,} kept), {r.new_tokens:,} new tokens, "
        f"{rate:,.0f} tokens/s"
    )


def _by_reason(counts: dict[str, int]) -> str:
    """' (exact duplicate 64, over max_length 3)': the reasons of the manifest, most frequent first."""
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])
    return f" ({', '.join(f'{why} {n:,}' for why, n in ordered)})" if ordered else ""


def said_prepare(r) -> str:
    dropped = sum(r.dropped.values())
    extra = f", {dropped:,} dropped{_by_reason(r.dropped)}" if dropped else ""
    quarantined = getattr(r, "quarantined_by_reason", None) or {}
    extra += f", {r.quarantined:,} quarantined{_by_reason(quarantined)}" if r.quarantined else ""
    return f"{r.n_samples:,} samples, {r.n_tokens:,} tokens of {r.n_rows:,} rows{extra}" + (
        " (reused)" if r.reused else ""
    )


def said_estimate(e) -> str:
    room = "fits" if e.fits else "DOES NOT FIT"
    gib = None if e.free_bytes is None else e.free_bytes / 2**30
    free = "" if gib is None else f", {gib:,.1f} GiB free" if gib >= 1 else f", {gib:,.3f} GiB free"  # not "0.0"
    return f"store about {e.store_bytes / 2**30:,.3f} GiB, {room}{free}" + (
        " (calibration reused)" if getattr(e, "calibration_reused", False) else ""
    )


def said_extract(plan, results) -> str:
    tokens = sum(r.tokens for r in results)
    if not tokens:
        where = shown(plan.version_path)
        return f"nothing to extract: {where} already holds every sample ({counted(plan.n_units, 'unit')})"
    wall = max((r.seconds for r in results), default=0.0)
    rate = f", {tokens / wall:,.0f} tokens/s" if wall else ""
    return f"{tokens:,} tokens in {counted(sum(len(r.units) for r in results), 'unit')}{rate}"


def said_train(r) -> str:
    if getattr(r, "reused", False):
        return f"reused: the training had finished ({r.steps} steps), export {r.export_dir}"
    # (a resumed training's first loss is its step 1's, from the training that began it: said so)
    since = " (step 1)" if r.start_step else ""
    loss = f", loss {r.first_loss:.3f}{since} -> {r.final_loss:.3f}" if r.first_loss is not None else ""
    stopped = " (interrupted)" if r.interrupted else ""
    return f"steps {r.start_step} -> {r.steps} of {r.total_steps}{loss}, {r.tokens_per_s:,.0f} tokens/s{stopped}"


def said_evaluate(a) -> str:
    base = a.untrained_acceptance_length
    line = f"acceptance length {a.acceptance_length:.3f}" + (f" (untrained drafter {base:.3f})" if base else "")
    reuse = getattr(a, "reuse_line", None)
    return line + (f"; {reuse()}" if callable(reuse) and reuse() else "")


SAID = {
    "probe": said_probe,
    "regenerate": said_regenerate,
    "prepare": said_prepare,
    "plan": said_estimate,
    "extract": said_extract,
    "validate": lambda v: "PASS" if v.ok else "FAIL",
    "train": said_train,
    "retain": lambda kept: kept.line(),
    "evaluate": said_evaluate,
}


def _reused_evaluation(a) -> list[str]:
    parts = ["the trained drafter's acceptance"] if getattr(a, "reused", False) else []
    return parts + (["the untrained baseline"] if getattr(a, "baseline_reused", False) else [])


REUSED = {
    "regenerate": lambda r: "" if r.generated else "the regenerated replies",
    "prepare": lambda r: "the prepared dataset" if r.reused else "",
    "plan": lambda e: "the store-size calibration" if getattr(e, "calibration_reused", False) else "",
    "extract": lambda plan, results: "" if sum(r.tokens for r in results) else "the extracted store",
    "train": lambda r: "the trained drafter" if getattr(r, "reused", False) else "",
    "evaluate": _reused_evaluation,
}
