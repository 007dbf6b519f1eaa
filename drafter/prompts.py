"""The evaluation's prompt rows (`evaluate.prompts`, `evaluate.slice_by`): read and checked here, without torch, so
that the CLI's pre-flight (core/preflight.py) checks them with the code the evaluate stage uses (drafter/evaluate.py),
before Prefect starts, not after extraction and training."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_pipeline.drafter.config import EvalConfig
from dflash_pipeline.errors import ConfigError, DataError

PROMPT_ENDS = ("user", "tool")  # the turn a prompt ends with: what the target replies to
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles a chat template renders


def check_slice_fields(rows: list[dict], fields: list[str], where: str) -> None:
    """Every row used has every `evaluate.slice_by` field, else a ConfigError naming the field, the first row
    without it and the fields the rows have."""
    for f in fields:
        missing = [i for i, r in enumerate(rows) if f not in r]
        if missing:
            i = missing[0]
            have = sorted({k for r in rows for k in r})
            raise ConfigError(
                f"evaluate.slice_by names {f!r}, but {len(missing)} of the {len(rows)} prompt rows of {where} lack "
                f"it (first: row {i + 1}, id {rows[i].get('id')!r}); the rows' fields are {have}: name one of "
                f"those in evaluate.slice_by, or add {f!r} to every row"
            )


def load_prompts(cfg: EvalConfig) -> list[dict]:
    """The prompt rows evaluated (the first evaluate.num_prompts), each with 'messages' ending with a user turn
    and every evaluate.slice_by field."""
    path = cfg.prompts
    if path == "embedded":
        from dflash_pipeline.embedded import heldout_prompts

        path = str(heldout_prompts())
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"evaluate.prompts={cfg.prompts!r}: no such file; give a JSONL of prompt rows or 'embedded'")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(
            f"evaluate.prompts={cfg.prompts!r} cannot be read ({getattr(e, 'strerror', None) or e})"
        ) from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p} line {n} is not JSON ({e}): evaluate.prompts needs one JSON object a line") from e
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise DataError(f"{p} line {n}: a prompt row is an object with 'messages' (a list of chat turns)")
        turns = row["messages"]
        which = f"{p} line {n} ({'id ' + repr(row['id']) if row.get('id') is not None else 'no id'})"
        for i, t in enumerate(turns):
            role = t.get("role") if isinstance(t, dict) else None
            if role not in CHAT_ROLES:  # (a fresh-user check: a misspelt role was called the last turn's problem)
                raise DataError(
                    f"{which}: turn {i} has {'role ' + repr(role) if role is not None else 'no role'}, not one of "
                    f"{', '.join(CHAT_ROLES)}: fix the row, or drop it"
                )
        last = turns[-1].get("role") if turns and isinstance(turns[-1], dict) else None
        if last not in PROMPT_ENDS:  # (a fresh-user check: a row ending with the reply was scored anyway)
            raise DataError(
                f"{which}: its messages end with "
                f"{'a turn of role ' + repr(last) if last else 'no chat turn'}; a prompt ends with the user's turn "
                "(or a tool result) that the target answers: drop the reply, or the row"
            )
        rows.append(row)
    rows = rows[: cfg.num_prompts] if cfg.num_prompts else rows
    check_slice_fields(rows, cfg.slice_by, str(p))
    return rows
