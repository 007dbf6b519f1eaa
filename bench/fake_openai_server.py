"""A tiny OpenAI-compatible server that answers instantly, for the regenerate client's overhead benchmark
(bench/regen_client_bench.py) and the flow-control tests (429/5xx bursts, API keys), which a real server cannot be
made to produce on demand. NOT a model server and not used by the pipeline.

HTTP/1.1 with keep-alive on plain asyncio streams (no framework), so that it costs far less CPU per request than
the client it measures. Endpoints: GET /v1/models, POST /v1/chat/completions (non-streaming), GET /health.

    python bench/fake_openai_server.py --port 8123 [--model fake] [--reply-tokens 200] [--reasoning]
        [--fail 503:5] [--fail 429:3] [--api-key SECRET] [--log requests.jsonl]

--fail STATUS:N answers the first N chat requests with STATUS (several --fail options run one after the other),
429s carry `Retry-After: 0`. --fail-at STATUS:I answers only the I-th chat request (1-based) with STATUS.
--hang N closes the connection of the first N chat requests without an answer; --slow N:S answers the first N
after S seconds (client timeouts). --api-key makes every request without `Authorization: Bearer SECRET` a 401.
--log appends each chat request's body (one JSON line) to a file. The reply's content repeats a word
--reply-tokens times (usage.completion_tokens says so); finish_reason is "length" when max_tokens is smaller.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

REASONS = {200: "OK", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}
REASONS |= {400: "Bad Request", 503: "Service Unavailable"}


class Fake:
    def __init__(self, args):
        self.args = args
        self.failures = []
        for spec in args.fail:
            status, n = spec.split(":")
            self.failures += [int(status)] * int(n)
        self.fail_at = {int(i): int(st) for st, i in (x.split(":") for x in args.fail_at)}
        self.chat_requests = 0
        self.hang = args.hang
        n, _, sec = (args.slow or "0:0").partition(":")
        self.slow_n, self.slow_s = int(n), float(sec)
        self.log = open(args.log, "a") if args.log else None

    def chat(self, body: dict) -> tuple[int, dict, dict]:
        self.chat_requests += 1
        if self.log:
            self.log.write(json.dumps(body) + "\n")
            self.log.flush()
        if self.failures or self.chat_requests in self.fail_at:
            status = self.failures.pop(0) if self.failures else self.fail_at[self.chat_requests]
            headers = {"Retry-After": "0"} if status == 429 else {}
            return status, {"error": {"message": f"fake {status} (burst)", "code": status}}, headers
        if body.get("model") != self.args.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}, {}
        n = self.args.reply_tokens
        cap = body.get("max_tokens") or n
        k = min(n, cap)
        msg = {"role": "assistant", "content": " ".join(["word"] * k)}
        if self.args.reasoning:
            msg["reasoning_content"] = "Let me think about this."
        resp = {
            "id": f"chatcmpl-{self.chat_requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.args.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": "length" if cap < n else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": k, "total_tokens": 10 + k},
        }
        return 200, resp, {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                extra: dict = {}
                if self.args.api_key and headers.get("authorization") != f"Bearer {self.args.api_key}":
                    status, resp = 401, {"error": {"message": "invalid or missing API key"}}
                elif method == "GET" and path.rstrip("/") == "/v1/models":
                    card = {"id": self.args.model, "object": "model", "root": self.args.root or None}
                    status, resp = 200, {"object": "list", "data": [card]}
                elif method == "GET" and path == "/health":
                    status, resp = 200, {"status": "ok"}
                elif method == "POST" and path == "/v1/chat/completions":
                    if self.hang > 0:
                        self.hang -= 1
                        self.chat_requests += 1
                        return  # the finally closes the connection: the client sees it dropped
                    if self.slow_n > 0:
                        self.slow_n -= 1
                        await asyncio.sleep(self.slow_s)
                    status, resp, extra = self.chat(json.loads(body))
                else:
                    status, resp = 404, {"error": {"message": f"no route {method} {path}"}}
                data = json.dumps(resp).encode()
                out = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}", "Content-Type: application/json"]
                out += [f"Content-Length: {len(data)}"] + [f"{k}: {v}" for k, v in extra.items()]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--root", default="", help="the weights behind the model name (vLLM's model card 'root')")
    ap.add_argument("--reply-tokens", type=int, default=200)
    ap.add_argument("--reasoning", action="store_true")
    ap.add_argument("--fail", action="append", default=[], help="STATUS:N, the first N chat requests get STATUS")
    ap.add_argument("--fail-at", action="append", default=[], help="STATUS:I, the I-th chat request gets STATUS")
    ap.add_argument("--hang", type=int, default=0, help="drop the first N chat requests' connections unanswered")
    ap.add_argument("--slow", default="", help="N:S, the first N chat requests are answered after S seconds")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--log", default="")
    args = ap.parse_args()
    fake = Fake(args)
    server = await asyncio.start_server(fake.handle, args.host, args.port, backlog=1024)
    print(f"listening on http://{args.host}:{args.port}/v1", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
