"""Dataset preparation: loss-mask exactness, quarantine of bad rows, filters, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_pipeline.dataprep.config import DataConfig
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
    # where in the row, as an editor counts: "{not json" breaks at its 2nd character (not "line 2, column 1")
    assert "at line 2, column 2" in q[2], q[2]


def test_a_cut_row_is_named_once_where_it_breaks(tmp_path, tokenizer):
    """json's "Unterminated string starting at" message is followed by our own " at line ...": one "at"."""
    src = _write_jsonl(tmp_path / "cut.jsonl", [{"messages": CONV}, '{"messages": [{"role": "user", "content": "hi'])
    res = prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "out")
    (reason,) = [x["reason"] for x in load_quarantine(res)]
    assert reason == "invalid JSON: Unterminated string starting at line 2, column 43", reason


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


def test_a_moved_output_dir_reuses_its_prepared_dataset_where_it_is_now(tmp_path, tokenizer):
    """The manifest records absolute paths; a run directory moved since (another disk) reads the data at its new
    place instead of failing on the old one (found by a damage check: a traceback naming the old directory)."""
    import shutil

    cfg = DataConfig(max_samples=20)
    a = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path / "a")
    shutil.move(tmp_path / "a", tmp_path / "moved")
    again = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path / "moved")
    assert again.reused and again.path == str(tmp_path / "moved" / a.fingerprint / "dataset")
    assert again.quarantine_path.startswith(str(tmp_path / "moved"))
    assert len(load_prepared(again.path)) == a.n_samples == 20


def test_sharegpt_and_messages_files_give_identical_samples(tmp_path, tokenizer):
    from dflash_pipeline.embedded.build import CONVERSATIONS, CONVERSATIONS_MESSAGES

    a = load_prepared(prepare_dataset(DataConfig(max_samples=50), str(CONVERSATIONS), tokenizer, tmp_path / "a").path)
    b = load_prepared(
        prepare_dataset(DataConfig(max_samples=50), str(CONVERSATIONS_MESSAGES), tokenizer, tmp_path / "b").path
    )
    assert a["sample_id"] == b["sample_id"] and a["input_ids"] == b["input_ids"]


# ---- issue 17: real chat data for thinking models, on the real Qwen3.5/3.6 vocabulary ----


def _supervised_turns(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def _reasoning_conversation(n_turns: int, seed: int) -> list[dict]:
    msgs = [{"role": "system", "content": f"System prompt {seed}."}] if seed % 2 else []
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"Question {seed}.{t}: what is {seed} + {t}?"})
        msgs.append(
            {
                "role": "assistant",
                "content": f"It is {seed + t}." + (" ✓" if t % 2 else ""),
                "reasoning_content": f"Step {t}: add {seed} and {t}.\nCheck twice.",
            }
        )
    return msgs


def _qwen36_expected(msgs: list[dict], preserve: bool) -> list[str]:
    """What the Qwen3.6-style template renders for each assistant turn, from its documented behaviour: reasoning
    kept after the last user query (or always with preserve_thinking), written `<think>\\n{r}\\n</think>\\n\\n{c}`;
    the generation prompt's `<think>\\n` is not generated, so a kept turn's supervision starts at the reasoning."""
    last_query = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            if i > last_query or preserve:
                out.append(m["reasoning_content"].strip() + "\n</think>\n\n" + m["content"].strip() + "<|im_end|>")
            else:
                out.append(m["content"].strip() + "<|im_end|>")
    return out


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("preserve", [True, False])
def test_acceptance_qwen36_reasoning_every_turn_all_kept_and_exact(tmp_path, enable_thinking, preserve):
    from tests.qwen_vocab import qwen_tokenizer

    tok = qwen_tokenizer("qwen3_6_style")
    convs = [_reasoning_conversation(1 + s % 4, s) for s in range(12)]
    src = _write_jsonl(tmp_path / "r.jsonl", [{"messages": c} for c in convs])
    kwargs = {"enable_thinking": enable_thinking, "preserve_thinking": preserve}
    res = prepare_dataset(DataConfig(chat_template_kwargs=kwargs), str(src), tok, tmp_path / "out")
    assert res.n_samples == 12 and res.quarantined == 0 and res.dropped == {}
    ds = load_prepared(res.path)
    for row in ds:
        msgs = convs[row["source_row"] - 1]
        assert _supervised_turns(tok, row["input_ids"], row["loss_mask"]) == _qwen36_expected(msgs, preserve)
        text = tok.apply_chat_template(msgs, tokenize=False, **kwargs)
        assert row["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]


def test_reasoning_policies_supervise_mask_drop(tmp_path):
    from tests.qwen_vocab import qwen_tokenizer

    tok = qwen_tokenizer("qwen3_6_style")
    src = _write_jsonl(tmp_path / "r.jsonl", [{"messages": _reasoning_conversation(2, 3)}])
    got = {}
    for policy in ("supervise", "mask", "drop"):
        res = prepare_dataset(DataConfig(reasoning=policy), str(src), tok, tmp_path / policy)
        row = load_prepared(res.path)[0]
        got[policy] = (_supervised_turns(tok, row["input_ids"], row["loss_mask"]), tok.decode(row["input_ids"]))
    assert got["supervise"][0][-1] == "Step 1: add 3 and 1.\nCheck twice.\n</think>\n\nIt is 4. ✓<|im_end|>"
    assert got["mask"][0][-1] == "It is 4. ✓<|im_end|>" and "Step 1" in got["mask"][1]  # rendered, not trained on
    assert "Step 1" not in got["drop"][1] and got["drop"][0][-1].endswith("It is 4. ✓<|im_end|>")


def test_think_prompt_template_keeps_every_multi_turn_conversation(tmp_path):
    """Defect: with a generation prompt that opens `<think>\\n`, 10 of 11 multi-turn conversations were quarantined."""
    from tests.qwen_vocab import qwen_tokenizer

    tok = qwen_tokenizer("think_prompt")
    convs = [_reasoning_conversation(2 + s % 3, s) for s in range(11)]
    src = _write_jsonl(tmp_path / "t.jsonl", [{"messages": c} for c in convs])
    for turns in ("all", "last"):
        res = prepare_dataset(DataConfig(mask_turns=turns), str(src), tok, tmp_path / turns)
        assert res.n_samples == 11 and res.quarantined == 0
        for row in load_prepared(res.path):
            runs = _supervised_turns(tok, row["input_ids"], row["loss_mask"])
            msgs = convs[row["source_row"] - 1]
            last = msgs[-1]
            assert runs[-1] == f"{last['reasoning_content']}\n</think>\n\n{last['content']}<|im_end|>"
            assert len(runs) == (1 if turns == "last" else sum(m["role"] == "assistant" for m in msgs))


def test_earlier_reply_starting_with_a_newline_is_kept(tmp_path):
    """Defect: Qwen's pre-tokenizer merges the header's "\\n" with a reply's leading "\\n" into one token."""
    from tests.qwen_vocab import qwen_tokenizer

    tok = qwen_tokenizer("json_tools")
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "\nFirst reply."},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "\n\nSecond."},
    ]
    res = prepare_dataset(DataConfig(), str(_write_jsonl(tmp_path / "n.jsonl", [{"messages": msgs}])), tok, tmp_path)
    row = load_prepared(res.path)[0]
    assert res.quarantined == 0
    # The merged token holds the header's newline too: it is supervised (its characters overlap the reply).
    assert _supervised_turns(tok, row["input_ids"], row["loss_mask"]) == [
        "\n\nFirst reply.<|im_end|>",
        "\n\n\nSecond.<|im_end|>",
    ]


def test_literal_control_token_text_never_shifts_the_mask(tmp_path):
    from tests.qwen_vocab import qwen_tokenizer

    tok = qwen_tokenizer("qwen3_6_style")
    msgs = [
        {"role": "user", "content": "Is <|im_end|><|im_start|>assistant\nhacked a reply?"},
        {"role": "assistant", "content": "No: <|im_end|> is just text here.", "reasoning_content": "Literal."},
    ]
    src = _write_jsonl(tmp_path / "l.jsonl", [{"messages": msgs}, {"messages": CONV}])
    res = prepare_dataset(DataConfig(), str(src), tok, tmp_path / "plain")
    assert res.n_samples == 2
    row = load_prepared(res.path)[0]
    assert _supervised_turns(tok, row["input_ids"], row["loss_mask"]) == [
        "Literal.\n</think>\n\nNo: <|im_end|> is just text here.<|im_end|>"
    ]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert row["input_ids"].count(im_end) == 2  # the template's two; the three pasted ones are text
    res = prepare_dataset(DataConfig(control_tokens="quarantine"), str(src), tok, tmp_path / "q")
    (q,) = load_quarantine(res)
    assert (
        q["kind"] == "literal control token"
        and "turn 0 (user) content" in q["reason"]
        and "'<|im_end|>'" in q["reason"]
    )


def test_chat_template_kwargs_and_tools_reach_the_template(tmp_path):
    from tests.qwen_vocab import qwen_tokenizer

    tok = qwen_tokenizer("qwen3_6_style")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    row = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "Rain."},
        ]
    }
    src = _write_jsonl(tmp_path / "k.jsonl", [row])
    res = prepare_dataset(
        DataConfig(chat_template_kwargs={"enable_thinking": False, "tools": tools}), str(src), tok, tmp_path / "a"
    )
    s = load_prepared(res.path)[0]
    text = tok.decode(s["input_ids"])
    assert "# Tools" in text and '"get_weather"' in text
    runs = _supervised_turns(tok, s["input_ids"], s["loss_mask"])
    # enable_thinking=false: the generation prompt already holds the empty think block, so it is not supervised.
    assert runs == [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "Rain.<|im_end|>",
    ]
    assert all("rain" not in r for r in runs)  # the tool result is not supervised
    other = prepare_dataset(DataConfig(), str(src), tok, tmp_path / "b")
    assert other.fingerprint != res.fingerprint


def test_same_data_from_two_output_dirs_has_one_fingerprint(tmp_path, tokenizer):
    """Issue 15: the regenerated source lives under output_dir; the fingerprint must follow its content only."""
    rows = [{"messages": CONV}]
    a = _write_jsonl(tmp_path / "run_a" / "regenerated.jsonl", rows) if (tmp_path / "run_a").mkdir() is None else None
    b = _write_jsonl(tmp_path / "run_b" / "regenerated.jsonl", rows) if (tmp_path / "run_b").mkdir() is None else None
    ra = prepare_dataset(DataConfig(source=str(a)), str(a), tokenizer, tmp_path / "run_a" / "prepared")
    rb = prepare_dataset(DataConfig(source=str(b)), str(b), tokenizer, tmp_path / "run_b" / "prepared")
    assert ra.fingerprint == rb.fingerprint and not rb.reused
    b.write_text(b.read_text().replace("2 + 2 = 4.", "2 + 2 = four."))
    assert prepare_dataset(DataConfig(), str(b), tokenizer, tmp_path / "c").fingerprint != ra.fingerprint


# ---- messy files ----


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_latin1_stops_under_auto_and_decodes_with_its_encoding(tmp_path, tokenizer, suffix):
    """Issue 27: auto read a Latin-1 file as ISO-8859-14 ("n°" became "nḞ", exit 0); it never guesses a code page."""
    turns = [{"role": "user", "content": "Room n° 5?"}, {"role": "assistant", "content": "Très bon, n° 5."}]
    rows = [{"messages": turns}]
    body = json.dumps(rows[0] if suffix == ".jsonl" else rows, ensure_ascii=False).encode("latin-1")
    src = tmp_path / f"latin{suffix}"
    src.write_bytes(b'{"messages": [{"role": "user", "content": "ascii"}]}\n' * (suffix == ".jsonl") + body)
    offset = src.read_bytes().index(b"\xb0")
    with pytest.raises(DataError) as e:
        prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "o")
    msg = str(e.value)
    assert str(src) in msg and f"byte offset {offset} " in msg and "data.encoding=latin-1" in msg
    res = prepare_dataset(DataConfig(encoding="latin-1"), str(src), tokenizer, tmp_path / "o2")
    assert res.encoding == "latin-1" and res.n_samples == 1
    text = tokenizer.decode(load_prepared(res.path)[0]["input_ids"])
    assert "Room n° 5?" in text and "Très bon, n° 5." in text and "Ḟ" not in text


def test_bom_is_accepted_and_bad_bytes_are_quarantined_with_offsets(tmp_path, tokenizer):
    good = json.dumps({"messages": CONV}, ensure_ascii=False).encode()
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    other = json.dumps({"data": ["héllo", "wörld reply"]}, ensure_ascii=False).encode()
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + bad + b"\n" + other + b"\n")
    res = prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "o")
    assert res.n_samples == 2 and res.quarantined == 1 and res.n_rows == 3
    (q,) = load_quarantine(res)
    offset = 3 + len(good) + 1 + bad.index(b"\xe9")
    assert q["row"] == 2 and q["kind"] == "undecodable bytes" and f"byte offset {offset} " in q["reason"]
    jsrc = tmp_path / "bom.json"
    jsrc.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"messages": CONV}]).encode())
    assert prepare_dataset(DataConfig(), str(jsrc), tokenizer, tmp_path / "j").n_samples == 1


def test_json_errors_name_file_line_and_column(tmp_path, tokenizer):
    src = tmp_path / "broken.json"
    src.write_text('[\n  {"messages": []},\n  {"messages": [}\n]')
    with pytest.raises(DataError, match=r"broken.json is not valid JSON: .* at line 3, column 17"):
        prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "o")
    lines = _write_jsonl(tmp_path / "l.jsonl", [{"messages": CONV}, '{"messages": [1, 2,, 3]}'])
    res = prepare_dataset(DataConfig(), str(lines), tokenizer, tmp_path / "p")
    (q,) = load_quarantine(res)
    assert q["row"] == 2 and "at line 2, column 20" in q["reason"]


def test_corrupt_parquet_and_arrow_give_one_error_naming_the_file(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"messages": [CONV] * 50})
    good = tmp_path / "good.parquet"
    pq.write_table(table, good, row_group_size=10)
    data = good.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) // 3 : len(data) // 3 + 64] = b"\x00" * 64
    (tmp_path / "flip.parquet").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match=r"cut.parquet is not a readable Parquet file"):
        prepare_dataset(DataConfig(), str(tmp_path / "cut.parquet"), tokenizer, tmp_path / "o")
    with pytest.raises(DataError, match=r"flip.parquet: Parquet row group \d+ \(rows \d+-\d+\) cannot be read"):
        prepare_dataset(DataConfig(), str(tmp_path / "flip.parquet"), tokenizer, tmp_path / "o")
    arrow = tmp_path / "rows.arrow"
    with pa.ipc.new_file(str(arrow), table.schema) as w:
        w.write_table(table)
    assert prepare_dataset(DataConfig(), str(arrow), tokenizer, tmp_path / "a").n_rows == 50
    (tmp_path / "cut.arrow").write_bytes(arrow.read_bytes()[:300])
    with pytest.raises(DataError, match=r"cut.arrow"):
        prepare_dataset(DataConfig(), str(tmp_path / "cut.arrow"), tokenizer, tmp_path / "o")


def test_unified_schema_parquet_with_nulls(tmp_path, tokenizer):
    import datasets
    import pyarrow.parquet as pq

    share = [{"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hi there, friend."}]
    rows = {
        "conversations": [share, None],
        "messages": [None, [{"from": None, "value": None, "role": "user", "content": "Hey"}]],
    }
    rows["messages"][1].append({"from": None, "value": None, "role": "assistant", "content": "Hello to you."})
    ds = datasets.Dataset.from_dict(rows)
    path = tmp_path / "u.parquet"
    ds.to_parquet(str(path))
    assert pq.read_table(path).num_rows == 2
    res = prepare_dataset(DataConfig(), str(path), tokenizer, tmp_path / "o")
    assert res.n_samples == 2 and res.quarantined == 0
    ds.save_to_disk(str(tmp_path / "saved"))
    assert prepare_dataset(DataConfig(), str(tmp_path / "saved"), tokenizer, tmp_path / "s").n_samples == 2


def test_all_rows_bad_still_writes_the_full_quarantine(tmp_path, tokenizer):
    long_reason_row = {"messages": [{"role": "user", "content": "x"}, {"role": "wizard: with a colon", "content": "y"}]}
    src = _write_jsonl(tmp_path / "bad.jsonl", ["nope", {"messages": []}, long_reason_row])
    with pytest.raises(DataError) as err:
        prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "out")
    msg = str(err.value)
    assert "3 rows read, 3 quarantined" in msg and "quarantine.jsonl" in msg and "unknown role 'wizard: with" in msg
    qpath = Path(msg.split("All reasons are in ")[1].split(".jsonl")[0] + ".jsonl")
    q = [json.loads(line) for line in qpath.read_text().splitlines()]
    assert [x["row"] for x in q] == [1, 2, 3] and "unknown role 'wizard: with a colon'" in q[2]["reason"]
    _write_jsonl(src, [{"messages": CONV}])  # fixed data: a new fingerprint, prepared normally
    assert prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "out").n_samples == 1


def test_counts_add_up_with_max_samples(tmp_path, tokenizer):
    rows = [{"messages": CONV}, "{bad", {"messages": CONV}] + [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer number {i}"}]}
        for i in range(20)
    ]
    src = _write_jsonl(tmp_path / "m.jsonl", rows)
    res = prepare_dataset(DataConfig(max_samples=5), str(src), tokenizer, tmp_path / "o")
    assert res.n_samples == 5 and res.quarantined == 1 and res.dropped == {"exact duplicate": 1}
    assert res.n_rows == res.n_samples + res.quarantined + sum(res.dropped.values()) == 7
    assert res.quarantined_by_reason == {"invalid JSON": 1} and sum(res.length_histogram.values()) == 5


def test_prepare_summary_artifact_counts_histogram_and_share(tmp_path, tokenizer):
    rows = [{"messages": CONV}, "{bad", {"messages": CONV}, {"messages": [{"role": "bot", "content": "x"}]}]
    res = prepare_dataset(DataConfig(), str(_write_jsonl(tmp_path / "s.jsonl", rows)), tokenizer, tmp_path / "o")
    from dflash_pipeline.tasks.prepare import summary_markdown  # imports Prefect, which takes over logging

    md = summary_markdown(res)
    assert "| rows read | 4 |" in md and "| kept (samples) | 1 |" in md and "| quarantined | 2 |" in md
    assert "| quarantined: invalid JSON | 1 |" in md and "| quarantined: unknown role | 1 |" in md
    assert "| dropped: exact duplicate | 1 |" in md
    share = 100 * res.n_supervised_tokens / res.n_tokens
    assert f"| supervised tokens | {res.n_supervised_tokens} ({share:.1f}%) |" in md
    (bin_,) = res.length_histogram
    assert f"| {bin_} | 1 |" in md and res.encoding == "utf-8"


def test_the_prepared_dataset_directory_has_a_plain_directorys_mode(tmp_path, tokenizer):
    """Made under a temporary name (mkdtemp: 0700) and renamed: a fresh-user check found it private to its owner
    where a plain mkdir gives 0777 less the umask (a team's outputs)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONV}])
        res = prepare_dataset(DataConfig(), str(src), tokenizer, tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE(Path(res.path).parent.stat().st_mode) == 0o755


def test_a_prepared_dataset_changed_since_it_was_made_is_prepared_again(tmp_path, tokenizer):
    """A damage check: a bit flipped in a prepared Arrow file was reused as it was; validation then failed on an
    intact store, and a unit deleted on its advice was re-extracted from the damaged tokens under the old sample ids.
    The manifest records each file's digest: a changed file is named, and the dataset is prepared again, equal to
    the first."""
    cfg = DataConfig(max_samples=20)
    a = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path)
    first = load_prepared(a.path)[:]
    assert a.files and all(len(d) == 32 for d in a.files.values())
    arrow = next(Path(a.path).glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 1
    arrow.write_bytes(bytes(data))
    again = prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path)
    assert not again.reused and again.files == a.files and load_prepared(again.path)[:] == first
    assert prepare_dataset(cfg, resolve_source("embedded"), tokenizer, tmp_path).reused
