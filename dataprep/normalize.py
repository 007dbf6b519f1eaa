"""Turn one raw dataset row (ShareGPT, OpenAI messages, UltraChat) into a checked list of messages.

A row that cannot be used raises RowError with a reason a person can act on; the caller quarantines
it with its row number and carries on.
"""

from __future__ import annotations

from typing import Any

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}


class RowError(Exception):
    """This row is unusable; `reason` says why (shown in the quarantine report)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def detect_format(row: dict[str, Any]) -> str:
    if "conversations" in row:
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if "data" in row:
        return "ultrachat"
    raise RowError(
        f"no conversation field: expected one of 'conversations' (ShareGPT), 'messages' "
        f"(OpenAI) or 'data' (UltraChat); the row has {sorted(row)}"
    )


def _turns(row: dict[str, Any], fmt: str) -> list[tuple[Any, Any]]:
    """(role, content) pairs as found in the row, not yet checked."""
    key = {"sharegpt": "conversations", "messages": "messages", "ultrachat": "data"}[fmt]
    turns = row.get(key)
    if not isinstance(turns, list):
        raise RowError(f"field '{key}' must be a list of turns, got {type(turns).__name__}")
    if fmt == "ultrachat":  # a list of strings, alternating user / assistant
        return [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(turns)]
    role_key, content_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError(f"turn {i} is a {type(t).__name__}, not an object with '{role_key}'/'{content_key}'")
        if role_key not in t:
            raise RowError(f"turn {i} has no '{role_key}' (role) field")
        out.append((t[role_key], t.get(content_key)))
    return out


def normalize_row(row: Any, fmt: str = "auto") -> list[dict[str, str]]:
    """Checked messages [{'role', 'content'}]: optional system first, then user/assistant alternating,
    starting with user, with at least one assistant turn. Trailing user turns (nothing to supervise)
    are dropped."""
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not a JSON object")
    fmt = detect_format(row) if fmt == "auto" else fmt
    messages = []
    for i, (role, content) in enumerate(_turns(row, fmt)):
        norm = ROLE_ALIASES.get(role.lower() if isinstance(role, str) else role)
        if norm is None:
            raise RowError(f"turn {i} has unknown role {role!r} (known: {', '.join(sorted(ROLE_ALIASES))})")
        if not isinstance(content, str):
            raise RowError(f"turn {i} ({norm}) content is {type(content).__name__}, not a string")
        if not content.strip():
            raise RowError(f"turn {i} ({norm}) content is empty")
        messages.append({"role": norm, "content": content})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            at = i + (len(messages) - len(body))
            raise RowError(
                f"wrong turn order at turn {at}: expected {expected}, got {m['role']} "
                "(a conversation is [system], user, assistant, user, assistant, ...)"
            )
    while messages and messages[-1]["role"] == "user":
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("conversation has no assistant turn: nothing to supervise")
    return messages
