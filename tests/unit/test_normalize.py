"""Dataset preparation: loss-mask exactness, quarantine of bad rows, filters, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_pipeline.dataprep.normalize import RowError, normalize_row

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n3 + 3 = 6."},
]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _expected_assistant_text(tokenizer, messages):
    """What the template renders inside each assistant turn: earlier turns lose their <think> block."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            content = m["content"]
            if i != len(messages) - 1 and "</think>" in content:
                content = content.split("</think>")[-1].lstrip("\n")
            out.append(content + "<|im_end|>")
    return out


@pytest.fixture(params=["generation-tags", "prefix-match"])
def any_template_tokenizer(request, tokenizer):
    """The embedded tokenizer, and a copy whose template has no {% generation %} tags (like Qwen's)."""
    if request.param == "generation-tags":
        return tokenizer
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return tok


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}, "no 'role'"),
        (
            {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            "unknown role 'wizard'",
        ),
        ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "yo"}]}, "content is empty"),
        ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "yo"}]}, "not a string"),
        ({"messages": [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "hi"}]}, "wrong turn order"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "wrong turn order"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"text": "hello"}, "no conversation field"),
    ],
)
def test_bad_rows_are_rejected_with_their_reason(row, reason):
    with pytest.raises(RowError, match=reason):
        normalize_row(row)


def test_formats_normalise_to_the_same_messages():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    ultra = {"data": ["hi", "hello"]}
    assert normalize_row({"messages": msgs}) == normalize_row(share) == normalize_row(ultra) == msgs
