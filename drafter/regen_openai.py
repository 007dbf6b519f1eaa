"""The regenerate stage's server backend: an OpenAI-compatible server (vLLM, SGLang, `transformers serve`) that
serves the target, through POST {base_url}/chat/completions.

- Concurrency: up to `regenerate.concurrency` conversations in flight (one request each at a time; an async httpx
  client, one connection per conversation in flight). The server batches them.
- Flow control: a request is retried with exponential backoff and jitter (tenacity; a Retry-After header is
  honoured) after a timeout, a connection error, HTTP 429 or 5xx, up to `max_retries` times, each retry logged.
  When they are used up the stage stops with an error (finished conversations are committed: a rerun continues).
  Other 4xx are never retried: 401/403 (the key), 404 (the URL or model) stop the stage with one error; any other
  4xx stops it too while no request has succeeded yet (the settings are wrong for this server, e.g. a field it
  does not take), and after that it marks that one conversation "failed" with the server's message (e.g. a prompt
  over the context length) and carries on.
- Start: GET {base_url}/models, waiting up to `server_wait_s` for a server that is still loading, then an error
  naming the URL; a model the server does not list is an error naming it and what the server serves.
- Multi-turn: each assistant turn to regenerate is requested in order, the earlier regenerated turns as context.
  Once a reply is cut by max_tokens and on_truncated is drop/quarantine, the later turns are not requested (the
  conversation is not kept; a quarantined one keeps the dataset's later turns).
- Reasoning: the reply's `reasoning_content` (vLLM before 0.10, SGLang, transformers serve) or `reasoning` (vLLM
  now), else a `<think>...</think>` block inside the content (a server without a reasoning parser); stored in the
  form the prepare stage renders (regen_output.assistant_message).
- The API key is read from the environment variable `api_key_env` and only ever put in the Authorization header:
  never logged, never in an error message, never written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from dflash_pipeline.drafter.config import RegenerateConfig
from dflash_pipeline.drafter.regen_output import (
    ProgressMeter,
    RegenerateError,
    RegenOutput,
    Reply,
    assistant_message,
    split_inline_think,
    turns_to_regenerate,
)

log = logging.getLogger(__name__)
POOL = 8  # connections per httpx client


class Transient(Exception):
    """A reply worth retrying: HTTP 429 or 5xx, or a 200 whose body is not a chat completion."""

    def __init__(self, what: str, retry_after: float | None = None):
        super().__init__(what)
        self.retry_after = retry_after


class Refused(Exception):
    """A 4xx other than 429: retrying cannot help."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class ServerFailed(RuntimeError):
    """Retries used up (server down or overloaded): not a user error, so the Prefect task retries the stage, which
    continues the output."""


def _transient(e: BaseException) -> bool:
    return isinstance(e, Transient | httpx.TimeoutException | httpx.TransportError)


def _detail(r: httpx.Response) -> str:
    try:
        body = r.json()
        if isinstance(body, dict):
            err = body.get("error", body.get("detail", body.get("message", body)))
            if isinstance(err, dict):
                err = err.get("message", err)
            return str(err)[:500]
    except ValueError:
        pass
    return r.text[:500]


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return float(r.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _api_key(cfg: RegenerateConfig) -> str | None:
    return os.environ.get(cfg.api_key_env) or None


class ServerClient:
    """The requests of one regeneration run (retries are counted on the progress meter)."""

    def __init__(self, cfg: RegenerateConfig, meter: ProgressMeter | None = None):
        self.cfg = cfg
        self.meter = meter
        self.url = cfg.base_url.rstrip("/")
        key = _api_key(cfg)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # One pool per POOL conversations in flight: httpcore's pool scans all its connections on every request
        # (CPU per request grew 1.3 -> 2.4 -> 4.8 ms at 8 / 64 / 256 connections in one pool; bench/RESULTS.md).
        self.pools = [
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(cfg.request_timeout_s, connect=min(30.0, cfg.request_timeout_s)),
                limits=httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL),
            )
            for _ in range(-(-cfg.concurrency // POOL))
        ]
        self.http = self.pools[0]
        self.model: str | None = cfg.model
        self.succeeded = 0

    async def aclose(self) -> None:
        for c in self.pools:
            await c.aclose()

    # ---- start ----
    async def preflight(self) -> dict:
        """Wait for the server, check that it serves the model; returns its model card (recorded in the output)."""
        url = f"{self.url}/models"
        deadline = time.monotonic() + self.cfg.server_wait_s
        while True:
            try:
                r = await self.http.get(url, timeout=min(10.0, self.cfg.request_timeout_s))
                if r.status_code < 500:
                    break
                err = f"HTTP {r.status_code}: {_detail(r)}"
            except (httpx.TimeoutException, httpx.TransportError) as e:
                err = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise RegenerateError(
                    f"cannot reach the OpenAI-compatible server at {self.cfg.base_url} ({err}; waited "
                    f"{self.cfg.server_wait_s:.0f} s, regenerate.server_wait_s). Start the server (docs/DRAFTER.md: "
                    "'Regenerating with vLLM or SGLang') or set regenerate.base_url to where it listens"
                )
            log.info("waiting for the server at %s (%s)", self.cfg.base_url, err)
            await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())) or 0.1)
        if r.status_code in (401, 403):
            raise self._key_error(r)
        if r.status_code == 404:
            hint = "" if self.url.endswith("/v1") else " (vLLM and SGLang serve it under /v1: did you mean .../v1?)"
            raise RegenerateError(
                f"{url} answered 404: regenerate.base_url={self.cfg.base_url!r} is not an OpenAI API root{hint}"
            )
        if r.status_code >= 400:
            raise RegenerateError(f"{url} answered HTTP {r.status_code}: {_detail(r)}")
        try:
            cards = [m for m in r.json()["data"] if isinstance(m, dict) and "id" in m]
        except (ValueError, KeyError, TypeError):
            raise RegenerateError(
                f"{url} did not answer with a model list: is regenerate.base_url={self.cfg.base_url!r} an "
                "OpenAI-compatible server?"
            ) from None
        served = [m["id"] for m in cards]
        if self.model is None:
            if len(served) != 1:
                raise RegenerateError(
                    f"the server at {self.cfg.base_url} serves {len(served)} models ({served}): set regenerate.model "
                    "to the one to use"
                )
            self.model = served[0]
        elif self.model not in served:
            raise RegenerateError(
                f"the server at {self.cfg.base_url} does not serve model {self.model!r}; it serves {served}. Set "
                "regenerate.model to one of them (vLLM: the --served-model-name, by default the model path given "
                "to `vllm serve`)"
            )
        card = next(m for m in cards if m["id"] == self.model)
        return {
            "base_url": self.cfg.base_url,
            "model": self.model,
            "card": {k: card[k] for k in ("id", "root", "owned_by", "max_model_len") if k in card},
        }

    def _key_error(self, r: httpx.Response) -> RegenerateError:
        have = "is set" if _api_key(self.cfg) else "is not set"
        return RegenerateError(
            f"the server at {self.cfg.base_url} refused the request (HTTP {r.status_code}: {_detail(r)}): it wants an "
            f"API key; the environment variable {self.cfg.api_key_env} (regenerate.api_key_env) {have}"
        )

    # ---- one reply ----
    def body(self, messages: list[dict], seed: int | None, tools: list | None) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
        }
        if cfg.top_k is not None:
            body["top_k"] = cfg.top_k
        if seed is not None:
            body["seed"] = seed
        if cfg.chat_template_kwargs:
            body["chat_template_kwargs"] = cfg.chat_template_kwargs
        if tools:
            body["tools"] = tools
        body.update(cfg.extra_body)
        return body

    async def reply(self, body: dict[str, Any], key: str, prompt_opens_think: bool, slot: int = 0) -> Reply:
        """One assistant reply; `slot` (0..concurrency-1, one per conversation in flight) picks the pool."""
        url = f"{self.url}/chat/completions"
        http = self.pools[slot // POOL]

        def wait(state: RetryCallState) -> float:
            exp = min(self.cfg.retry_max_wait_s, 0.5 * 2 ** (state.attempt_number - 1))
            w = random.uniform(exp / 2, exp)
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, Transient) and exc.retry_after is not None:
                w = max(w, min(exc.retry_after, self.cfg.retry_max_wait_s))
            return w

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if self.meter is not None:
                self.meter.retries += 1
            log.warning(
                "retry %d/%d of conversation %s in %.1f s: %s from %s",
                state.attempt_number,
                self.cfg.max_retries,
                key,
                state.next_action.sleep if state.next_action else 0.0,
                f"{type(exc).__name__}: {exc}" if not isinstance(exc, Transient) else exc,
                url,
            )

        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.cfg.max_retries + 1),
                wait=wait,
                retry=retry_if_exception(_transient),
                before_sleep=before_sleep,
                reraise=True,
            ):
                with attempt:
                    r = await http.post(url, json=body)
                    if r.status_code == 429 or r.status_code >= 500:
                        raise Transient(f"HTTP {r.status_code}: {_detail(r)}", _retry_after(r))
                    if r.status_code >= 400:
                        raise Refused(r.status_code, _detail(r))
                    try:
                        data = r.json()
                        choice = data["choices"][0]
                        msg = choice["message"]
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise Transient(f"HTTP {r.status_code} with a body that is not a chat completion") from None
        except Refused as e:
            if e.status in (401, 403):
                raise RegenerateError(
                    f"the server at {self.cfg.base_url} refused the request (HTTP {e.status}: {e.detail}): check the "
                    f"API key in the environment variable {self.cfg.api_key_env} (regenerate.api_key_env)"
                ) from None
            if e.status == 404 or not self.succeeded:
                raise RegenerateError(
                    f"{url} refused the first requests (HTTP {e.status}: {e.detail}). Check regenerate.model, the "
                    "sampling settings and regenerate.extra_body against what this server takes (e.g. "
                    "`transformers serve` rejects top_k)"
                ) from None
            raise
        except Exception as e:
            if _transient(e):
                last = e if isinstance(e, Transient) else f"{type(e).__name__}: {e}"
                raise ServerFailed(
                    f"the server at {self.cfg.base_url} failed conversation {key} {self.cfg.max_retries + 1} times "
                    f"(last: {last}). The finished conversations are saved: rerun to continue, "
                    "or raise regenerate.max_retries / request_timeout_s"
                ) from None
            raise
        self.succeeded += 1
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning is None:  # no reasoning parser on the server: the think block is in the content
            reasoning, content = split_inline_think(content, prompt_opens_think)
        usage = data.get("usage") or {}
        tool_calls = [
            {"type": "function", "function": tc["function"]}
            for tc in (msg.get("tool_calls") or [])
            if isinstance(tc, dict) and "function" in tc
        ]
        return Reply(
            content=content,
            reasoning=reasoning or None,
            finish=choice.get("finish_reason") or "stop",
            tokens=usage.get("completion_tokens"),
            tool_calls=tool_calls or None,
        )


def _seed(cfg: RegenerateConfig, key: str, turn: int) -> int | None:
    """Reproducible per conversation and turn, whatever order the requests go in."""
    if cfg.seed is None:
        return None
    return (cfg.seed + zlib.crc32(key.encode()) * 64 + turn) % (2**31 - 1)


async def _conversation(
    client: ServerClient, key: str, messages: list[dict], tools, form: str, opens_think: bool, slot: int
) -> tuple[list[dict], list[Reply], str]:
    conv = [dict(m) for m in messages]
    replies: list[Reply] = []
    for turn, i in enumerate(turns_to_regenerate(conv, client.cfg.turns)):
        try:
            body = client.body(conv[:i], _seed(client.cfg, key, turn), tools)
            r = await client.reply(body, key, opens_think, slot)
        except Refused as e:
            return conv, replies, f"HTTP {e.status}: {e.detail}"
        conv[i] = assistant_message(r, form, conv[i])
        replies.append(r)
        if r.truncated and client.cfg.on_truncated != "keep":
            break  # the conversation will not be kept: spare the server its later turns
    return conv, replies, ""


async def _run(cfg, model: str, pending, out: RegenOutput, meter: ProgressMeter, form: str, opens_think: bool):
    client = ServerClient(cfg, meter)
    client.model = model
    it = iter(pending)

    async def worker(slot: int) -> None:  # one per conversation in flight; `slot` picks its connection pool
        while (item := next(it, None)) is not None:
            key, messages, tools = item
            conv, replies, error = await _conversation(client, key, messages, tools, form, opens_think, slot)
            if out.commit(key, conv, replies, cfg.on_truncated, error) == "failed":
                log.warning("conversation %s failed (recorded in %s): %s", key, out.rejected_path.name, error)
            meter.tick()

    workers = [asyncio.create_task(worker(s)) for s in range(cfg.concurrency)]
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()  # a stage-stopping error propagates from here
    finally:
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await client.aclose()


async def _preflight(cfg: RegenerateConfig) -> dict:
    client = ServerClient(cfg)
    try:
        return await client.preflight()
    finally:
        await client.aclose()


def check_server(cfg: RegenerateConfig) -> dict:
    """Wait for the server and check that it serves regenerate.model: {"base_url", "model", "card"}."""
    return asyncio.run(_preflight(cfg))


def run_openai(
    cfg: RegenerateConfig,
    model: str,
    pending: Iterator[tuple[str, list[dict], list | None]],
    out: RegenOutput,
    meter: ProgressMeter,
    form: str,
    opens_think: bool,
) -> None:
    """Regenerate the `pending` conversations (key, messages, tools) through the server, committing each to `out`."""
    asyncio.run(_run(cfg, model, pending, out, meter, form, opens_think))
