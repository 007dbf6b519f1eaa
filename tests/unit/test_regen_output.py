"""The regenerate stage's shared output (drafter/regen_output.py) and request building (drafter/regen_openai.py):
reasoning forms, turn selection, the truncation policy, resume, the settings record."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from dflash_pipeline.drafter.config import RegenerateConfig
from dflash_pipeline.drafter.regen_openai import ServerClient, _seed
from dflash_pipeline.drafter.regen_output import (
    ProgressMeter,
    RegenerateError,
    RegenerateMismatch,
    RegenOutput,
    Reply,
    assistant_message,
    length_stats,
    split_inline_think,
    template_reads_reasoning,
    turns_to_regenerate,
)

CONV = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2"},
]


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("plain answer", False, (None, "plain answer")),
        ("<think>\nwhy\n</think>\n\nanswer", False, ("why", "answer")),
        ("why\n</think>\n\nanswer", True, ("why", "answer")),  # the prompt opened the block
        ("<think>\ncut by max_tok", False, ("cut by max_tok", "")),  # a think block cut by max_tokens
        ("still thinking", True, ("still thinking", "")),
        ("a</think>b", False, ("a", "b")),  # no opening tag, a closing one: what came before it is reasoning
    ],
)
def test_split_inline_think(text, opened, want):
    assert split_inline_think(text, opened) == want


def test_reasoning_forms():
    r = Reply(content="answer", reasoning="\nwhy\n")
    orig = {"role": "assistant", "content": "old", "reasoning_content": "old why", "name": "bot"}
    assert assistant_message(r, "field", orig) == {
        "role": "assistant",
        "name": "bot",
        "content": "answer",
        "reasoning_content": "why",
    }
    assert assistant_message(r, "inline", orig) == {
        "role": "assistant",
        "name": "bot",
        "content": "<think>\nwhy\n</think>\n\nanswer",
    }
    plain = assistant_message(Reply(content="answer"), "field", orig)
    assert plain == {"role": "assistant", "name": "bot", "content": "answer"}  # the dataset's reasoning is gone


def test_turns_to_regenerate():
    assert turns_to_regenerate(CONV, "all") == [2, 4]
    assert turns_to_regenerate(CONV, "last") == [4]
    tools = [*CONV[:2], {"role": "assistant", "content": "", "tool_calls": [{}]}, {"role": "tool", "content": "r"}]
    tools += [{"role": "assistant", "content": "a"}]
    assert turns_to_regenerate(tools, "all") == [4]  # a turn with tool calls keeps the dataset's calls


def test_template_reads_reasoning():
    assert template_reads_reasoning(SimpleNamespace(chat_template="{{ m.reasoning_content }}"))
    assert template_reads_reasoning(SimpleNamespace(chat_template={"default": "{{ message.reasoning }}"}))
    assert not template_reads_reasoning(SimpleNamespace(chat_template="{{ m.content }}"))
    assert not template_reads_reasoning(SimpleNamespace(chat_template=None))


SETTINGS = {"backend": "openai", "model": "m", "temperature": 0.0}


def _out(tmp_path, settings=SETTINGS):
    return RegenOutput(tmp_path / "c.jsonl", settings, {"base_url": "http://127.0.0.1:1/v1"})


def _lines(p):
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.parametrize(
    ("policy", "outcome", "where"),
    [("keep", "truncated_kept", "kept"), ("drop", "dropped", "rejected"), ("quarantine", "quarantined", "rejected")],
)
def test_truncation_policy(tmp_path, policy, outcome, where):
    out = _out(tmp_path)
    cut = [Reply("a1", tokens=3), Reply("a2 cut", finish="length", tokens=8)]
    assert out.commit("x", CONV, cut, policy) == outcome
    assert out.commit("y", CONV, [Reply("a1", tokens=3), Reply("a2", tokens=4)], policy) == "ok"
    out.close()
    kept, rejected = _lines(tmp_path / "c.jsonl"), _lines(tmp_path / "c.rejected.jsonl")
    row = (kept if where == "kept" else rejected)[0]
    assert row["id"] == "x" and row["regen"]["finish"] == ["stop", "length"] and row["regen"]["tokens"] == [3, 8]
    assert ("messages" in row) == (outcome != "dropped")
    assert [r["id"] for r in kept] == (["x", "y"] if where == "kept" else ["y"])


def test_failed_conversation_goes_to_rejected(tmp_path):
    out = _out(tmp_path)
    assert out.commit("x", CONV, [], "quarantine", error="HTTP 400: too long") == "failed"
    out.close()
    (row,) = _lines(tmp_path / "c.rejected.jsonl")
    assert row["outcome"] == "failed" and row["reason"] == "HTTP 400: too long" and "messages" not in row


def test_resume_cuts_a_torn_line_and_skips_both_files(tmp_path):
    out = _out(tmp_path)
    out.commit("a", CONV, [Reply("1", tokens=1)], "quarantine")
    out.commit("b", CONV, [Reply("1", finish="length", tokens=5)], "quarantine")
    out.close()
    kept = tmp_path / "c.jsonl"
    good = kept.read_bytes()
    kept.write_bytes(good + b'{"id": "c", "messages": [{"ro')  # killed mid-write
    again = _out(tmp_path)
    assert again.done == {"a", "b"} and kept.read_bytes() == good
    assert again.earlier.outcomes == {"ok": 1, "quarantined": 1} and again.earlier.turn_tokens == [1, 5]
    again.close()


def test_an_id_twice_is_an_error(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"id": "a", "messages": []}\n{"id": "a", "messages": []}\n')
    (tmp_path / "c.run.json").write_text(json.dumps({"version": 1, "settings": SETTINGS, "server": {}}))
    with pytest.raises(RegenerateError, match="hold an id twice"):
        _out(tmp_path)


def test_other_settings_refuse_to_mix(tmp_path):
    out = _out(tmp_path)
    out.commit("a", CONV, [Reply("1")], "keep")
    out.close()
    with pytest.raises(RegenerateMismatch, match=r"model: 'm' before, 'other' now.*another output_dir"):
        _out(tmp_path, {**SETTINGS, "model": "other"})
    _out(tmp_path).close()  # the same settings continue it


def test_settings_may_change_before_any_line(tmp_path):
    _out(tmp_path).close()
    _out(tmp_path, {**SETTINGS, "temperature": 0.7}).close()
    assert json.loads((tmp_path / "c.run.json").read_text())["settings"]["temperature"] == 0.7


def test_lines_without_a_record_are_refused(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"id": "a", "messages": []}\n')
    with pytest.raises(RegenerateMismatch, match="no settings record"):
        _out(tmp_path)


def test_progress_rates_and_eta(tmp_path):
    out = _out(tmp_path)
    seen = []
    meter = ProgressMeter(out, total=4, callback=seen.append, every_s=0)
    out.commit("a", CONV, [Reply("1", tokens=10), Reply("2", tokens=30)], "keep")
    meter.tick()
    p = seen[-1]
    assert (p.done, p.total, p.generated, p.new_tokens, p.failed) == (1, 4, 1, 40, 0)
    assert p.conversations_per_s > 0 and p.tokens_per_s > 0 and p.eta_s is not None and p.eta_s > 0
    assert "1/4 conversations" in p.line() and "ETA" in p.line()
    out.close()


def test_length_stats():
    s = length_stats(list(range(1, 101)))
    assert s["turns"] == 100 and s["min"] == 1 and s["max"] == 100 and s["p50"] == 51 and s["mean"] == 50.5
    assert length_stats([]) == {}


def test_request_body_sends_only_what_is_set():
    cfg = RegenerateConfig(backend="openai", model="m", max_new_tokens=7, extra_body={"min_p": 0.1})
    body = ServerClient(cfg).body([{"role": "user", "content": "q"}], 5, None)
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}],
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 5,
        "min_p": 0.1,
    }
    cfg = RegenerateConfig(backend="openai", model="m", top_k=20, chat_template_kwargs={"enable_thinking": True})
    body = ServerClient(cfg).body([], None, [{"type": "function"}])
    assert body["top_k"] == 20 and body["chat_template_kwargs"] == {"enable_thinking": True} and "seed" not in body
    assert body["tools"] == [{"type": "function"}]


def test_seeds_differ_per_conversation_and_turn_and_are_stable():
    cfg = RegenerateConfig(seed=3)
    assert _seed(cfg, "a", 0) == _seed(cfg, "a", 0) != _seed(cfg, "a", 1) != _seed(cfg, "b", 0)
    assert _seed(RegenerateConfig(seed=None), "a", 0) is None


def test_extra_body_cannot_override_the_stage():
    with pytest.raises(ValidationError, match=r"extra_body sets \['messages', 'model'\]"):
        RegenerateConfig(extra_body={"model": "x", "messages": []})


def test_one_writer_at_a_time(tmp_path):
    out = _out(tmp_path)
    with pytest.raises(RegenerateError, match="another process is regenerating into"):
        _out(tmp_path)
    out.close()
    _out(tmp_path).close()
