"""Turn one raw dataset row (ShareGPT, OpenAI messages with reasoning and tool calls, UltraChat) into a checked
conversation.

A row that cannot be used raises RowError with a short `kind` (counted in the manifest) and a reason a person can
act on; the caller quarantines it with its row number and carries on.

The row format is decided per row from the fields that hold a value, so Parquet or `datasets` data with a unified
schema (every column present, nulls in the unused ones) works; `data.format` fixes it instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
    "observation": "tool",
}
FORMAT_FIELDS = {"sharegpt": "conversations", "messages": "messages", "ultrachat": "data"}
REASONING_FIELDS = ("reasoning_content", "reasoning")
REASONING_POLICIES = ("supervise", "mask", "drop")
_INLINE_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)


class RowError(Exception):
    """This row is unusable; `kind` is a short category (counted), `reason` says exactly why."""

    def __init__(self, reason: str, kind: str = "invalid row"):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


@dataclass
class Conversation:
    """Checked messages ({'role', 'content'}, plus 'reasoning_content' / 'tool_calls' on assistant turns) and the
    row's tool definitions (OpenAI `tools`), both passed to the chat template as they are."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)


def detect_format(row: dict[str, Any]) -> str:
    present = [fmt for fmt, key in FORMAT_FIELDS.items() if row.get(key) is not None]
    if len(present) == 1:
        return present[0]
    if not present:
        raise RowError(
            "no conversation field: expected one of 'conversations' (ShareGPT), 'messages' (OpenAI) or 'data' "
            f"(UltraChat) with a value; the row has {sorted(row)}",
            "no conversation field",
        )
    raise RowError(
        f"several conversation fields hold values ({', '.join(FORMAT_FIELDS[f] for f in present)}); "
        "set data.format to the one to read",
        "ambiguous format",
    )


def _text(value: Any, where: str) -> str | None:
    """A message's content as a string: strings as they are, OpenAI content parts joined, None kept."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        out = []
        for p in value:
            if p.get("type", "text") != "text" or not isinstance(p.get("text"), str):
                raise RowError(
                    f"{where} has a content part of type {p.get('type')!r}; only text is supported", "bad content"
                )
            out.append(p["text"])
        return "".join(out)
    raise RowError(f"{where} content is {type(value).__name__}, not a string", "bad content")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls as {'type': 'function', 'function': {'name', 'arguments': dict}} (arguments parsed from
    their JSON string: templates render a mapping)."""
    if not isinstance(value, list):
        raise RowError(f"{where} tool_calls is {type(value).__name__}, not a list", "bad tool call")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(f"{where} tool call {j} has no function name", "bad tool call")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise RowError(
                    f"{where} tool call {j} ({fn['name']}) arguments are not valid JSON: {e.msg} at character {e.pos}",
                    "bad tool call",
                ) from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise RowError(f"{where} tool call {j} ({fn['name']}) arguments are not an object", "bad tool call")
        norm = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and call.get("id") is not None:
            norm["id"] = call["id"]
        out.append(norm)
    return out


def _turns(row: dict[str, Any], fmt: str) -> list[dict[str, Any]]:
    """Raw turns as {'role', 'content', ...}, from whichever per-turn keys hold values."""
    key = FORMAT_FIELDS[fmt]
    turns = row.get(key)
    if key not in row:  # (a fresh-user check: "got NoneType" for rows of another format under a forced data.format)
        fields = ", ".join(repr(k) for k in list(row)[:6])
        raise RowError(
            f"no field '{key}', which data.format={fmt} reads the turns from (the row has {fields or 'no fields'}): "
            "set data.format to the rows' format, or auto",
            "invalid row",
        )
    if not isinstance(turns, list):
        raise RowError(f"field '{key}' must be a list of turns, got {type(turns).__name__}", "invalid row")
    if fmt == "ultrachat":  # a list of strings, alternating user / assistant
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError(f"turn {i} is a {type(t).__name__}, not an object with a role and content", "invalid row")
        role = t.get("role") if t.get("role") is not None else t.get("from")
        if role is None:
            raise RowError(f"turn {i} has no 'role' (or 'from') field", "bad turn")
        content = t.get("content") if t.get("content") is not None else t.get("value")
        out.append({**t, "role": role, "content": content})
    return out


def _message(i: int, t: dict[str, Any], reasoning: str) -> dict[str, Any]:
    role = t["role"]
    norm = ROLE_ALIASES.get(role.lower() if isinstance(role, str) else role)
    if norm is None:
        raise RowError(f"turn {i} has unknown role {role!r} (known: {', '.join(sorted(ROLE_ALIASES))})", "unknown role")
    where = f"turn {i} ({norm})"
    content = _text(t.get("content"), where)
    msg: dict[str, Any] = {"role": norm}
    if norm == "assistant":
        if t.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(t["tool_calls"], where)
        think = next((t[k] for k in REASONING_FIELDS if t.get(k) is not None), None)
        if think is not None and not isinstance(think, str):
            raise RowError(f"{where} reasoning is {type(think).__name__}, not a string", "bad content")
        if content is None and not msg.get("tool_calls") and not think:
            raise RowError(f"{where} has no content (null) and no tool calls", "bad content")
        content = content or ""
        if reasoning == "drop":
            content = drop_inline_think(content)
        elif think:
            msg["reasoning_content"] = think
    elif content is None or not content.strip():
        raise RowError(f"{where} content is empty", "empty content")
    elif norm == "tool":  # some templates name the tool or the call a result answers
        msg.update({k: t[k] for k in ("name", "tool_call_id") if isinstance(t.get(k), str)})
    msg["content"] = content
    return msg


def drop_inline_think(content: str) -> str:
    """Content without a leading `<think>...</think>` block (reasoning written inline, DeepSeek-R1 style)."""
    return _INLINE_THINK.sub("", content, count=1) if "</think>" in content else content


def _check_order(messages: list[dict[str, Any]]) -> None:
    prev = None
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system":
            ok = prev in (None, "system")
            expected = "system messages only at the start"
        elif role == "user":
            ok = prev in (None, "system", "assistant", "tool")
            expected = "a user turn after the system prompt, an assistant or a tool turn"
        elif role == "assistant":
            ok = prev in ("user", "tool")
            expected = "an assistant turn after a user or tool turn"
        else:
            ok = prev == "tool" or (prev == "assistant" and messages[i - 1].get("tool_calls"))
            expected = "a tool turn after an assistant turn with tool_calls"
        if not ok:
            raise RowError(
                f"wrong turn order at turn {i}: {role} after {prev or 'the start'} (expected {expected}; "
                "a conversation is [system], user, assistant, user, assistant, ... with tool turns after tool calls)",
                "wrong turn order",
            )
        prev = role


def normalize_row(row: Any, fmt: str = "auto") -> list[dict[str, Any]]:
    """The checked messages of a row (see normalize_conversation)."""
    return normalize_conversation(row, fmt).messages


def normalize_conversation(row: Any, fmt: str = "auto", reasoning: str = "supervise") -> Conversation:
    """A checked conversation: [system...], then user / assistant turns (tool turns after tool calls), with at
    least one assistant turn. Trailing user and tool turns (nothing to supervise) are dropped."""
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not a JSON object", "invalid row")
    fmt = detect_format(row) if fmt == "auto" else fmt
    messages = [_message(i, t, reasoning) for i, t in enumerate(_turns(row, fmt))]
    _check_order(messages)
    while messages and messages[-1]["role"] in ("user", "tool"):
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("conversation has no assistant turn: nothing to supervise", "no assistant turn")
    tools = row.get("tools")
    if isinstance(tools, str):  # datasets often store the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise RowError("field 'tools' is a string that is not JSON", "bad tool call") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(x, dict) for x in tools)):
        raise RowError("field 'tools' must be a list of tool definitions (objects)", "bad tool call")
    return Conversation(messages, tools or None)
