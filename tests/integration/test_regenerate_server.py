"""The regenerate stage through a real OpenAI-compatible server (issue 18).

The server is `transformers serve` (transformers' `serving` extra) run by the test on this CPU machine, offline,
serving the tiny embedded target from its local directory: real HTTP, the real OpenAI chat-completions schema, the
real reasoning parser (the tiny target thinks `<think>...</think>` on arithmetic questions, as it was trained to,
and the server's Qwen3.5 response parser returns that as `reasoning_content`). Nothing of the API is mocked.

429/5xx bursts and API keys cannot be produced on demand by a real model server, so those cases use the small
server of the client benchmark (bench/fake_openai_server.py), also a real HTTP server in its own process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_pipeline.drafter.config import RegenerateConfig
from dflash_pipeline.drafter.regen_openai import ServerFailed
from dflash_pipeline.drafter.regen_output import RegenerateError, RegenerateMismatch
from dflash_pipeline.drafter.regenerate import regenerate
from dflash_pipeline.embedded.build import CONVERSATIONS_MESSAGES

ROOT = Path(__file__).resolve().parents[2]
N_CONV = 30
MAX_NEW = 32  # cuts the longest replies of the embedded target (33-token animal descriptions)
pytestmark = pytest.mark.server


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"server exited: {proc.stdout.read().decode()[-3000:] if proc.stdout else ''}"
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"no answer from {url} in {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tserve(model_dir):
    """`transformers serve` on the embedded target: {"url", "model"}."""
    port = _port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "transformers"), "serve", model_dir, "--host", "127.0.0.1"]
        + ["--port", str(port), "--device", "cpu", "--dtype", "float32"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 180)
        yield {"url": f"http://127.0.0.1:{port}/v1", "model": model_dir}
    finally:
        _stop(proc)


@pytest.fixture
def fake(tmp_path):
    """Start bench/fake_openai_server.py with the given options: returns its base URL."""
    procs = []

    def start(*args: str) -> str:
        port = _port()
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "fake_openai_server.py"), "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 30)
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for p in procs:
        _stop(p)


@pytest.fixture(scope="module")
def report(model_dir, tmp_path_factory):
    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config

    out = tmp_path_factory.mktemp("regen_probe")
    return stages.probe(load_config(overrides={"output_dir": str(out), "extract.devices": "cpu"}))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The first N_CONV embedded conversations (23 with several assistant turns, 6 arithmetic ones that think)."""
    p = tmp_path_factory.mktemp("regen_src") / "source.jsonl"
    lines = CONVERSATIONS_MESSAGES.read_text().splitlines()[:N_CONV]
    p.write_text("\n".join(lines) + "\n")
    return p


def _cfg(server: dict, **kw) -> RegenerateConfig:
    base = dict(
        backend="openai",
        base_url=server["url"],
        model=server["model"],
        max_new_tokens=MAX_NEW,
        concurrency=4,
        on_truncated="quarantine",
        server_wait_s=5,
    )
    return RegenerateConfig(**{**base, **kw})


def _lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.fixture(scope="module")
def clean(tserve, report, source, tmp_path_factory):
    """One uninterrupted regeneration through the server."""
    out = tmp_path_factory.mktemp("regen_clean") / "conversations.jsonl"
    progress = []
    res = regenerate(str(source), out, report, _cfg(tserve), fmt="messages", progress=progress.append)
    return res, out, progress


def test_multi_turn_through_server(clean, source, tserve):
    res, out, progress = clean
    src = {r["id"]: r for r in _lines(source)}
    kept, rejected = _lines(out), _lines(out.with_name("conversations.rejected.jsonl"))
    assert res.total == N_CONV and res.generated == N_CONV and res.backend == "openai"
    assert sorted(r["id"] for r in kept + rejected) == sorted(src)  # every conversation exactly once
    assert res.outcomes["ok"] == len(kept) and res.outcomes["quarantined"] == len(rejected) >= 1
    # a reply cut by max_tokens is marked and quarantined whole (on_truncated=quarantine)
    assert all(r["outcome"] == "quarantined" and "length" in r["regen"]["finish"] for r in rejected)
    assert all(r["messages"] for r in rejected)
    for r in kept:
        orig = src[r["id"]]["messages"]
        assert [m["role"] for m in r["messages"]] == [m["role"] for m in orig]
        # user and system turns are the dataset's; every assistant turn was regenerated, in order
        for m, o in zip(r["messages"], orig):
            if m["role"] != "assistant":
                assert m == o
        n_asst = sum(m["role"] == "assistant" for m in orig)
        assert r["regen"]["finish"] == ["stop"] * n_asst and all(t > 0 for t in r["regen"]["tokens"])
    # observable: progress (rates, ETA), summary with an output length distribution
    last = progress[-1]
    assert last.done == last.total == N_CONV and last.conversations_per_s > 0 and last.tokens_per_s > 0
    assert last.eta_s == 0 and last.failed == 0
    assert res.turn_tokens["max"] <= MAX_NEW and res.turn_tokens["turns"] > N_CONV
    record = json.loads(out.with_name("conversations.run.json").read_text())
    assert record["settings"]["model"] == res.model == record["server"]["card"]["id"]
    assert record["settings"]["max_new_tokens"] == MAX_NEW and record["server"]["base_url"] == tserve["url"]


def test_later_turns_see_the_regenerated_history(clean, tserve, source):
    """Turn 2 of a conversation was generated with the regenerated turn 1 as context: asking the server again with
    that history gives the same (greedy) reply."""
    _, out, _ = clean
    row = next(r for r in _lines(out) if sum(m["role"] == "assistant" for m in r["messages"]) >= 2)
    second = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"][1]
    r = httpx.post(
        tserve["url"] + "/chat/completions",
        json={"model": tserve["model"], "messages": row["messages"][:second], "max_tokens": MAX_NEW, "temperature": 0},
        timeout=60,
    ).json()
    assert r["choices"][0]["message"]["content"] in row["messages"][second]["content"]


def test_reasoning_reaches_prepared_samples(clean, report, tmp_path):
    """The server returns the target's think block as reasoning_content; it is stored in the form the prepare stage
    renders for this template (inline: the embedded template has no reasoning field) and is in the prepared tokens
    and loss mask."""
    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config
    from dflash_pipeline.dataprep.prepare import load_prepared
    from dflash_pipeline.extraction.tokenizer import load_tokenizer

    res, out, _ = clean
    assert res.reasoning_turns >= 1
    thinking = [r for r in _lines(out) if r["regen"].get("reasoning_turns")]
    assert thinking
    msg = next(m for m in thinking[0]["messages"][::-1] if m["role"] == "assistant")
    assert msg["content"].startswith("<think>\n") and "\n</think>\n\n" in msg["content"]
    reasoning = msg["content"].split("</think>")[0].removeprefix("<think>\n").strip()
    assert reasoning
    cfg = load_config(overrides={"output_dir": str(tmp_path), "data.source": str(out), "data.format": "messages"})
    prepared = stages.prepare(cfg, report)
    tok = load_tokenizer(report.tokenizer_path)
    ds = load_prepared(prepared.path)
    texts = [
        tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m], skip_special_tokens=False)
        for row in ds
    ]
    assert any(reasoning in t and "<think>" in t for t in texts)


# The embedded template with a Qwen3-style reasoning field: the last assistant turn's reasoning_content is rendered
# as <think>\n...\n</think>\n\n before its content (the prompt for generation is the same as the embedded one).
REASONING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if message.reasoning_content is defined and message.reasoning_content and loop.last -%}"
    "{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def test_reasoning_field_reaches_prepared_samples(tserve, model_dir, source, tmp_path):
    """A target whose template reads reasoning_content: the server's reasoning_content is stored there (form
    'auto' picks it) and the prepare stage renders it into the supervised tokens."""
    import shutil

    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config
    from dflash_pipeline.dataprep.prepare import load_prepared
    from dflash_pipeline.extraction.tokenizer import load_tokenizer

    target = tmp_path / "target"
    shutil.copytree(model_dir, target)
    (target / "chat_template.jinja").write_text(REASONING_TEMPLATE)
    base = {"output_dir": str(tmp_path / "run"), "extract.devices": "cpu", "target.model_path": str(target)}
    report = stages.probe(load_config(overrides=base))
    rows = [r for r in _lines(source) if "+" in json.dumps(r)][:3]
    src = tmp_path / "math.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "field.jsonl"
    res = regenerate(str(src), out, report, _cfg(tserve, turns="last"), fmt="messages")
    assert res.reasoning_turns >= 1
    assert json.loads(out.with_name("field.run.json").read_text())["settings"]["reasoning_form"] == "field"
    last = [next(m for m in r["messages"][::-1] if m["role"] == "assistant") for r in _lines(out)]
    thinking = [m for m in last if m.get("reasoning_content")]
    assert thinking and all("<think>" not in m["content"] for m in last)
    cfg = load_config(overrides={**base, "data.source": str(out), "data.format": "messages"})
    ds = load_prepared(stages.prepare(cfg, report).path)
    tok = load_tokenizer(report.tokenizer_path)
    texts = [
        tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m], skip_special_tokens=False)
        for row in ds
    ]
    want = thinking[0]["reasoning_content"]
    assert any(f"<think>\n{want}\n</think>\n\n" in t for t in texts), texts

    # the transformers backend writes the same output (same model, greedy): same messages, same reasoning field
    hf = tmp_path / "hf.jsonl"
    hf_cfg = RegenerateConfig(max_new_tokens=MAX_NEW, turns="last", device="cpu")
    regenerate(str(src), hf, report, hf_cfg, fmt="messages")
    assert {r["id"]: r["messages"] for r in _lines(hf)} == {r["id"]: r["messages"] for r in _lines(out)}


def test_kill_half_way_then_rerun(clean, tserve, report, source, tmp_path):
    """SIGKILL the stage (a subprocess) half-way, rerun it: every conversation exactly once, the lines finished
    before the kill untouched, and the same replies as the uninterrupted run."""
    _, clean_out, _ = clean
    out = tmp_path / "conversations.jsonl"
    cfg = _cfg(tserve)
    child = (
        "import sys, json\n"
        "from dflash_pipeline.drafter.config import RegenerateConfig\n"
        "from dflash_pipeline.drafter.regenerate import regenerate\n"
        "from dflash_pipeline.extraction.probe import ProbeReport\n"
        "a = json.loads(sys.argv[1])\n"
        "regenerate(a['src'], a['out'], ProbeReport.from_json(a['report']), RegenerateConfig(**a['cfg']),"
        " fmt='messages')\n"
    )
    arg = json.dumps({"src": str(source), "out": str(out), "report": report.to_json(), "cfg": cfg.model_dump()})
    proc = subprocess.Popen([sys.executable, "-c", child, arg], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rejected = out.with_name("conversations.rejected.jsonl")
    deadline = time.time() + 120
    while len(_lines(out)) + len(_lines(rejected)) < N_CONV // 2:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before_kept, before_rej = out.read_bytes(), rejected.read_bytes() if rejected.exists() else b""
    n_before = before_kept.count(b"\n") + before_rej.count(b"\n")
    assert N_CONV // 2 <= n_before < N_CONV

    res = regenerate(str(source), out, report, cfg, fmt="messages")
    after_kept, after_rej = out.read_bytes(), rejected.read_bytes()
    assert after_kept.startswith(before_kept[: before_kept.rfind(b"\n") + 1])  # finished lines untouched
    assert after_rej.startswith(before_rej[: before_rej.rfind(b"\n") + 1])
    ids = [r["id"] for r in _lines(out) + _lines(rejected)]
    assert len(ids) == len(set(ids)) == N_CONV and res.generated == N_CONV - n_before
    assert res.total == N_CONV and res.outcomes == clean[0].outcomes
    want = {r["id"]: r["messages"] for r in _lines(clean_out)}
    assert {r["id"]: r["messages"] for r in _lines(out)} == want  # greedy: the same replies


def test_other_settings_refuse_to_mix(clean, tserve, report, source):
    _, out, _ = clean
    with pytest.raises(RegenerateMismatch, match=r"temperature: 0\.0 before, 0\.7 now"):
        regenerate(str(source), out, report, _cfg(tserve, temperature=0.7), fmt="messages")


def test_unreachable_server_names_the_url(report, source, tmp_path):
    url = f"http://127.0.0.1:{_port()}/v1"
    cfg = _cfg({"url": url, "model": "m"}, server_wait_s=0.5)
    t0 = time.time()
    with pytest.raises(RegenerateError, match=f"cannot reach the OpenAI-compatible server at {url}"):
        regenerate(str(source), tmp_path / "o.jsonl", report, cfg, fmt="messages")
    assert time.time() - t0 < 15
    assert not (tmp_path / "o.jsonl").exists()


def test_wrong_model_name(tserve, report, source, tmp_path):
    cfg = _cfg({**tserve, "model": "Qwen/Qwen3-8B"})
    with pytest.raises(RegenerateError, match=r"does not serve model 'Qwen/Qwen3-8B'; it serves \["):
        regenerate(str(source), tmp_path / "o.jsonl", report, cfg, fmt="messages")


def test_field_the_server_rejects_is_one_clear_error(tserve, report, source, tmp_path):
    """transformers serve answers 422 to top_k: not retried, one error naming the URL and the server's words."""
    with pytest.raises(RegenerateError, match=r"HTTP 422.*top_k"):
        regenerate(str(source), tmp_path / "o.jsonl", report, _cfg(tserve, top_k=5), fmt="messages")


# ---- flow control, against the bench's fake server (a real HTTP server that fails on demand) ----------------
def test_429_and_5xx_bursts_are_retried(fake, report, source, tmp_path, caplog):
    url = fake("--model", "m", "--reply-tokens", "5", "--fail", "503:3", "--fail", "429:2", "--fail", "500:1")
    caplog.set_level(logging.WARNING, logger="dflash_pipeline")
    res = regenerate(
        str(source), tmp_path / "o.jsonl", report, _cfg({"url": url, "model": "m"}, concurrency=2), fmt="messages"
    )
    assert res.retries == 6 and res.outcomes["ok"] == N_CONV and res.failed == 0
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 6
    assert any("HTTP 503" in m for m in retries) and any("HTTP 429" in m for m in retries)


def test_timeouts_and_dropped_connections_are_retried(fake, report, source, tmp_path, caplog):
    url = fake("--model", "m", "--reply-tokens", "5", "--hang", "2", "--slow", "1:3")
    caplog.set_level(logging.WARNING, logger="dflash_pipeline")
    cfg = _cfg({"url": url, "model": "m"}, concurrency=1, request_timeout_s=1.0)
    res = regenerate(str(source), tmp_path / "o.jsonl", report, cfg, fmt="messages")
    assert res.retries == 3 and res.outcomes["ok"] == N_CONV
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert sum("ReadTimeout" in m for m in retries) == 1
    assert sum("RemoteProtocolError" in m for m in retries) == 2


def test_persistent_5xx_stops_with_one_error(fake, report, source, tmp_path):
    url = fake("--model", "m", "--reply-tokens", "5", "--fail", "500:1000")
    cfg = _cfg({"url": url, "model": "m"}, max_retries=2, retry_max_wait_s=0.05, concurrency=1)
    with pytest.raises(ServerFailed, match=r"failed conversation conv-0000 3 times \(last: HTTP 500"):
        regenerate(str(source), tmp_path / "o.jsonl", report, cfg, fmt="messages")


def test_api_key_from_env_never_written(fake, report, source, tmp_path, caplog, monkeypatch):
    secret = "sk-test-4f1c9e"
    url = fake("--model", "m", "--reply-tokens", "5", "--api-key", secret)
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "o.jsonl"
    monkeypatch.delenv("REGEN_TEST_KEY", raising=False)
    with pytest.raises(RegenerateError, match="environment variable REGEN_TEST_KEY .* is not set"):
        regenerate(str(source), out, report, _cfg({"url": url, "model": "m"}, api_key_env="REGEN_TEST_KEY"))
    monkeypatch.setenv("REGEN_TEST_KEY", secret)
    res = regenerate(str(source), out, report, _cfg({"url": url, "model": "m"}, api_key_env="REGEN_TEST_KEY"))
    assert res.outcomes["ok"] == N_CONV
    for f in tmp_path.iterdir():
        assert secret not in f.read_text(), f
    assert secret not in caplog.text


def test_refused_conversation_is_recorded_not_retried(fake, report, source, tmp_path):
    """A 4xx after requests succeeded (e.g. a prompt over the context length) marks that one conversation failed,
    with the server's message; a rerun does not ask again."""
    url = fake("--model", "m", "--reply-tokens", "5", "--fail-at", "400:4")
    cfg = _cfg({"url": url, "model": "m"}, concurrency=1)
    out = tmp_path / "o.jsonl"
    res = regenerate(str(source), out, report, cfg, fmt="messages")
    assert res.failed == 1 and res.outcomes["failed"] == 1 and res.outcomes["ok"] == N_CONV - 1 and res.retries == 0
    (row,) = _lines(tmp_path / "o.rejected.jsonl")
    assert row["outcome"] == "failed" and "HTTP 400: fake 400" in row["reason"]
    again = regenerate(str(source), out, report, cfg, fmt="messages")
    assert again.generated == 0 and again.outcomes == res.outcomes


def test_first_requests_refused_stop_the_stage(fake, report, source, tmp_path):
    url = fake("--model", "m", "--fail", "400:1")
    with pytest.raises(RegenerateError, match=r"refused the first requests \(HTTP 400: fake 400"):
        regenerate(str(source), tmp_path / "o.jsonl", report, _cfg({"url": url, "model": "m"}), fmt="messages")


def test_requests_carry_history_settings_and_extra_fields(fake, report, source, tmp_path):
    """What goes over the wire: every assistant turn in order with the regenerated history, the sampling settings,
    chat_template_kwargs and extra_body passed through; turns=last asks once, for the final turn."""
    log = tmp_path / "requests.jsonl"
    url = fake("--model", "m", "--reply-tokens", "3", "--log", str(log))
    two = next(r for r in _lines(source) if sum(m["role"] == "assistant" for m in r["messages"]) == 2)
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(two) + "\n")
    extra = {"min_p": 0.05, "repetition_penalty": 1.0}
    cfg = _cfg(
        {"url": url, "model": "m"},
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=11,
        chat_template_kwargs={"enable_thinking": True},
        extra_body=extra,
    )
    regenerate(str(src), tmp_path / "all.jsonl", report, cfg, fmt="messages")
    first, second = _lines(log)
    a1 = [i for i, m in enumerate(two["messages"]) if m["role"] == "assistant"]
    assert first["messages"] == two["messages"][: a1[0]]
    assert second["messages"][a1[0]] == {"role": "assistant", "content": "word word word"}  # regenerated context
    assert second["messages"][a1[0] + 1 :] == two["messages"][a1[0] + 1 : a1[1]]
    for body in (first, second):
        assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["top_k"] == 20
        assert body["max_tokens"] == MAX_NEW and body["chat_template_kwargs"] == {"enable_thinking": True}
        assert body["min_p"] == 0.05 and body["repetition_penalty"] == 1.0 and body["model"] == "m"
    assert first["seed"] != second["seed"]

    regenerate(str(src), tmp_path / "last.jsonl", report, cfg.model_copy(update={"turns": "last"}), fmt="messages")
    (only,) = _lines(log)[2:]
    assert only["messages"] == two["messages"][: a1[1]]  # the dataset's own earlier turns
    (row,) = _lines(tmp_path / "last.jsonl")
    assert row["messages"][a1[0]] == two["messages"][a1[0]] and row["messages"][a1[1]]["content"] == "word word word"


def test_no_requests_after_a_cut_reply_that_will_not_be_kept(fake, report, source, tmp_path):
    log = tmp_path / "requests.jsonl"
    url = fake("--model", "m", "--reply-tokens", "50", "--log", str(log))
    three = next(r for r in _lines(source) if sum(m["role"] == "assistant" for m in r["messages"]) == 3)
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(three) + "\n")
    res = regenerate(str(src), tmp_path / "q.jsonl", report, _cfg({"url": url, "model": "m"}), fmt="messages")
    assert res.outcomes["quarantined"] == 1 and len(_lines(log)) == 1
    (row,) = _lines(tmp_path / "q.rejected.jsonl")
    assert row["regen"]["finish"] == ["length"]
    res = regenerate(
        str(src), tmp_path / "k.jsonl", report, _cfg({"url": url, "model": "m"}, on_truncated="keep"), fmt="messages"
    )
    assert res.outcomes["truncated_kept"] == 1 and len(_lines(log)) == 4  # keep: every turn still regenerated


def test_base_url_without_v1_is_named_with_the_fix(fake, report, source, tmp_path):
    url = fake("--model", "m").removesuffix("/v1")
    with pytest.raises(RegenerateError, match=r"answered 404: regenerate.base_url=.* did you mean \.\.\./v1\?"):
        regenerate(str(source), tmp_path / "o.jsonl", report, _cfg({"url": url, "model": "m"}), fmt="messages")


def test_same_served_name_other_weights_refuse_to_mix(fake, report, source, tmp_path):
    """vLLM's model card names the weights behind --served-model-name ('root'): other weights under the same name
    are other settings."""
    out = tmp_path / "o.jsonl"
    a = fake("--model", "m", "--reply-tokens", "3", "--root", "/models/qwen3-8b-v1")
    regenerate(str(source), out, report, _cfg({"url": a, "model": "m"}), fmt="messages", max_samples=3)
    b = fake("--model", "m", "--reply-tokens", "3", "--root", "/models/qwen3-8b-v2")
    with pytest.raises(RegenerateMismatch, match="model_root: '/models/qwen3-8b-v1' before, '/models/qwen3-8b-v2' now"):
        regenerate(str(source), out, report, _cfg({"url": b, "model": "m"}), fmt="messages", max_samples=3)
    res = regenerate(str(source), out, report, _cfg({"url": a, "model": "m"}), fmt="messages")  # the same: continues
    assert res.generated == N_CONV - 3


def test_a_source_row_edited_since_is_regenerated_again(fake, report, source, tmp_path):
    """A damage check: a source row edited after its regeneration (same id, another prompt) was skipped by id on the
    rerun, so the nightly run's "changed rows are extracted again" never reached it. Each conversation records a
    digest of the row it was made from; an edited row is regenerated under `id@digest`, the others are not asked."""
    url = fake("--model", "m", "--reply-tokens", "5")
    cfg = _cfg({"url": url, "model": "m"}, concurrency=1)
    src, out = tmp_path / "src.jsonl", tmp_path / "o.jsonl"
    rows = [json.loads(x) for x in source.read_text().splitlines()]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = regenerate(str(src), out, report, cfg, fmt="messages")
    assert first.generated == N_CONV and all(len(r["source"]) == 32 for r in _lines(out))
    assert regenerate(str(src), out, report, cfg, fmt="messages").generated == 0
    user = next(m for m in rows[3]["messages"] if m["role"] == "user")
    user["content"] += " (edited)"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = regenerate(str(src), out, report, cfg, fmt="messages")
    assert again.generated == 1
    new = _lines(out)[-1]
    key = rows[3].get("id") or "row-3"
    assert new["id"].startswith(f"{key}@") and any("(edited)" in str(m.get("content")) for m in new["messages"])
    assert regenerate(str(src), out, report, cfg, fmt="messages").generated == 0
