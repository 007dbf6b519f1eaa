"""Dataset preparation: loss-mask exactness, quarantine of bad rows, filters, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_pipeline.config import DataConfig
from dflash_pipeline.dataprep.prepare import load_prepared, load_quarantine, prepare_dataset
from dflash_pipeline.dataprep.render import render
from dflash_pipeline.embedded import resolve_source
from dflash_pipeline.errors import DataError

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


def test_loss_mask_covers_exactly_the_assistant_content(any_template_tokenizer):
    tok = any_template_tokenizer
    r = render(tok, CONV)
    assert len(r.input_ids) == len(r.loss_mask)
    spans, cur = [], []
    for i, m in enumerate(r.loss_mask + [0]):
        if m:
            cur.append(r.input_ids[i])
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    # Every masked-in token lies inside assistant content (spans decode to it exactly), every assistant
    # token is masked in (nothing of it is missing), scaffolding and other roles are excluded.
    assert spans == _expected_assistant_text(tok, CONV)
    unmasked = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask) if not m])
    assert "You are terse." in unmasked and "What is 2 + 2?" in unmasked and "<|im_start|>assistant\n" in unmasked
    assert "2 + 2 = 4." not in unmasked and "3 + 3 = 6." not in unmasked
    # The thinking block of the earlier turn is not rendered at all; the last turn's is supervised.
    assert "Add them." not in tok.decode(r.input_ids) and "Again." in spans[-1]


def test_last_turn_only(tokenizer):
    r = render(tokenizer, CONV, mask_turns="last")
    masked = tokenizer.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m])
    assert masked == _expected_assistant_text(tokenizer, CONV)[-1]


def test_quarantine_report_and_good_rows_survive(tmp_path, tokenizer):
    good = {"messages": CONV}
    src = _write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            good,
            "{not json",
            {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"conversations": [{"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hi there, friend."}]},
        ],
    )
    res = prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "out")
    assert res.n_samples == 2 and res.quarantined == 3
    q = {x["row"]: x["reason"] for x in load_quarantine(res)}
    assert set(q) == {2, 3, 4}  # 1-based line numbers, as an editor shows them
    assert "invalid JSON" in q[2] and "no assistant turn" in q[3] and "unknown role 'bot'" in q[4]


def test_nothing_usable_is_a_clear_error(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "bad.jsonl", ["nope", {"messages": []}])
    with pytest.raises(DataError, match="no usable samples.*2 rows read, 2 quarantined"):
        prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "out")


def test_missing_source_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        prepare_dataset(DataConfig(), str(tmp_path / "nope.jsonl"), tokenizer, tmp_path / "out")


def test_filters_duplicates_overlength_and_min_supervised(tmp_path, tokenizer):
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 400}]}
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}, {"messages": CONV}, short, long])
    res = prepare_dataset(DataConfig(max_length=160, min_supervised_tokens=4), str(src), tokenizer, tmp_path / "a")
    assert res.n_samples == 1
    assert res.dropped == {"exact duplicate": 1, "over max_length": 1, "fewer than 4 supervised tokens": 1}
    res = prepare_dataset(
        DataConfig(max_length=160, overlength="truncate", min_supervised_tokens=4), str(src), tokenizer, tmp_path / "b"
    )
    lens = load_prepared(res.path)["seq_len"]
    assert res.n_samples == 2 and "over max_length" not in res.dropped and max(lens) == 160


def test_determinism_same_fingerprint_same_shards(tmp_path, tokenizer):
    cfg = DataConfig(max_samples=80, rows_per_shard=25)
    a = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path / "a")
    b = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path / "b")
    assert a.fingerprint == b.fingerprint and a.num_shards == b.num_shards == 4
    shards_a = sorted(Path(a.path).glob("*.arrow"))
    shards_b = sorted(Path(b.path).glob("*.arrow"))
    assert [p.name for p in shards_a] == [p.name for p in shards_b]
    for pa, pb in zip(shards_a, shards_b):
        assert pa.read_bytes() == pb.read_bytes()
    again = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path / "a")
    assert again.reused and again.fingerprint == a.fingerprint
    other = prepare_dataset(DataConfig(max_samples=81), resolve_source("embedded"), tokenizer, tmp_path / "a")
    assert other.fingerprint != a.fingerprint


def test_sharegpt_and_messages_files_give_identical_samples(tmp_path, tokenizer):
    from dflash_pipeline.embedded.build import CONVERSATIONS, CONVERSATIONS_MESSAGES

    a = load_prepared(prepare_dataset(DataConfig(max_samples=50), str(CONVERSATIONS), tokenizer, tmp_path / "a").path)
    b = load_prepared(
        prepare_dataset(DataConfig(max_samples=50), str(CONVERSATIONS_MESSAGES), tokenizer, tmp_path / "b").path
    )
    assert a["sample_id"] == b["sample_id"] and a["input_ids"] == b["input_ids"]
