"""Row normalisation: formats (also unified schemas with nulls), reasoning fields, tool calls, rejected rows."""

from __future__ import annotations

import pytest

from dflash_pipeline.dataprep.normalize import RowError, normalize_conversation, normalize_row


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


def test_reasoning_fields_reach_the_messages_and_drop_removes_them():
    row = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning": "be kind"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nyes", "reasoning_content": None},
        ]
    }
    msgs = normalize_conversation(row).messages
    assert msgs[1]["reasoning_content"] == "be kind" and "reasoning_content" not in msgs[3]
    dropped = normalize_conversation(row, reasoning="drop").messages
    assert "reasoning_content" not in dropped[1] and dropped[3]["content"] == "yes"


def test_unified_schema_with_nulls_is_read_per_row():
    """Parquet / datasets data: every column present, nulls in the unused ones (format and per-turn keys)."""
    share = {
        "conversations": [
            {"from": "human", "value": "hi", "role": None, "content": None},
            {"from": "gpt", "value": "hello", "role": None, "content": None},
        ],
        "messages": None,
        "data": None,
    }
    msgs = {"conversations": None, "messages": [{"role": "user", "content": "hi"}, _ASSISTANT_HELLO], "data": None}
    assert normalize_row(share) == normalize_row(msgs) == [{"role": "user", "content": "hi"}, _ASSISTANT_HELLO]
    with pytest.raises(RowError, match="several conversation fields hold values.*set data.format"):
        normalize_row({**share, "messages": msgs["messages"]})
    assert normalize_row({**share, "messages": msgs["messages"]}, "messages")[1]["content"] == "hello"


_ASSISTANT_HELLO = {"role": "assistant", "content": "hello"}


def test_tool_calls_and_tool_turns():
    row = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "thanks"},
        ],
        "tools": '[{"type": "function", "function": {"name": "w"}}]',
    }
    conv = normalize_conversation(row)
    assert conv.tools == [{"type": "function", "function": {"name": "w"}}]
    assert conv.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "P"}}, "id": "c1"}],
    }
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "tool turn after an assistant turn"),
        (
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                },
            ],
            "arguments are not valid JSON",
        ),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
            "no content \\(null\\) and no tool calls",
        ),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "content part of type 'image_url'"),
    ],
)
def test_bad_tool_rows_are_rejected(messages, reason):
    with pytest.raises(RowError, match=reason):
        normalize_conversation({"messages": messages})


def test_empty_assistant_reply_is_kept():
    msgs = [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]
    assert normalize_row({"messages": msgs}) == msgs


def test_a_forced_format_names_the_field_it_reads_and_the_rows_own():
    """A fresh-user check: data.format=sharegpt on rows of `messages` said "got NoneType" for every row."""
    row = {"id": "r1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(RowError, match=r"no field 'conversations', which data.format=sharegpt reads .*'messages'"):
        normalize_row(row, "sharegpt")
