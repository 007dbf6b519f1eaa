"""What a run did (`RunSummary`): the CLI prints it, the flow returns it, the summary artifact shows it. Filled in
place by dflash_pipeline.order.run_pipeline as the stages end, so a failed run has it too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.errors import ValidationFailed


@dataclass(kw_only=True)
class RunSummary:
    """What a run did; the CLI prints it, the flow returns it, the summary artifact shows it."""

    output_dir: str
    store: str
    layer_ids: list[int] = field(default_factory=list)
    regenerated: str | None = None
    prepared: str | None = None
    version: str | None = None
    planned_store_bytes: int | None = None  # the pre-flight plan's store size (core/planner.py)
    units: int | None = None
    new_units: int | None = None
    new_samples: int | None = None
    tokens_extracted: int | None = None
    forward_passes: int | None = None
    previous_current: str | None = None
    current: str | None = None
    validation: str | None = None  # PASS / FAIL, None when not run
    pruned: list[str] = field(default_factory=list)
    drafter: str | None = None
    retention: str | None = None  # what retention.mode deleted (None: keep)
    bytes_freed: int | None = None  # by retention, from the trained version so far
    final_loss: float | None = None
    acceptance_length: float | None = None
    untrained_acceptance_length: float | None = None
    acceptance_by: dict[str, dict[str, float]] = field(default_factory=dict)  # evaluate.slice_by: {field: {value: tau}}
    reused: list[str] = field(default_factory=list)  # what this run reused of earlier ones (core/progress.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record_failure(self, e: BaseException) -> None:
        """What a run that failed with `e` leaves known: a validation that raised failed (its report never came
        back as a result), and CURRENT is where it was (a failed run never moves it; a fresh-user check found
        failed nights' summaries saying 'validation not run' and 'CURRENT after: None')."""
        if isinstance(e, ValidationFailed) and self.validation is None:
            self.validation = "FAIL"
        if self.current is None:
            self.current = self.previous_current


@dataclass(frozen=True, kw_only=True)
class StopReport:
    """How a run that did not finish ended: its final state (Cancelled, Crashed), the stage it was in, why in words
    ("cancelled by the user", "serve was stopped", "the worker process died ..."), where it stopped (the last
    checkpoint, the commit records) and what resumes it. The run-summary artifact is headed with it, the flow run's
    final state and its last log line say it."""

    state: str
    stage: str
    cause: str
    where: str
    resume: str

    def line(self) -> str:
        return f"{self.state} at {self.stage}: {self.cause}. Stopped at {self.where}. Resume: {self.resume}"
