"""The regenerate stage's own client overhead (issue 18): the whole stage (source reading, requests through httpx,
reply parsing, one committed line per conversation) against bench/fake_openai_server.py, a local server that answers
instantly, so that everything measured is the client's.

    .venv/bin/python bench/regen_client_bench.py --conversations 2000 --concurrency 64 --reply-tokens 500

Reports conversations/s and requests/s of the stage, and the client process's CPU seconds per request (user +
system, all threads: time.process_time around the stage), with the server's CPU for reference. A vLLM server doing
5,000 output tokens/s at R tokens per reply needs 5000/R requests/s from the client.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=500, help="words in each fake reply (~tokens)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config
    from dflash_pipeline.drafter.config import RegenerateConfig
    from dflash_pipeline.drafter.regenerate import regenerate
    from dflash_pipeline.embedded.build import CONVERSATIONS_MESSAGES

    work = Path(tempfile.mkdtemp(prefix="regen_bench_"))
    report = stages.probe(load_config(overrides={"output_dir": str(work), "extract.devices": "cpu"}))
    base = [json.loads(x) for x in CONVERSATIONS_MESSAGES.read_text().splitlines()]
    src = work / "source.jsonl"
    with open(src, "w") as f:
        for i in range(args.conversations):
            f.write(json.dumps({**base[i % len(base)], "id": f"c{i}"}) + "\n")
    requests = sum(
        sum(m["role"] == "assistant" for m in base[i % len(base)]["messages"]) for i in range(args.conversations)
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_openai_server.py"), "--port", str(port), "--model", "fake"]
        + ["--reply-tokens", str(args.reply_tokens)],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        cfg = RegenerateConfig(
            backend="openai",
            base_url=f"http://127.0.0.1:{port}/v1",
            model="fake",
            concurrency=args.concurrency,
            max_new_tokens=args.reply_tokens + 1,
        )
        server_cpu0, cpu0, t0 = _cpu_of(server.pid), time.process_time(), time.perf_counter()
        res = regenerate(str(src), work / "out.jsonl", report, cfg, fmt="messages")
        wall, cpu, server_cpu = time.perf_counter() - t0, time.process_time() - cpu0, _cpu_of(server.pid) - server_cpu0
    finally:
        server.terminate()
        server.wait()
    assert res.generated == args.conversations and res.outcomes["ok"] == args.conversations, res
    out = {
        "conversations": args.conversations,
        "requests": requests,
        "concurrency": args.concurrency,
        "reply_tokens": args.reply_tokens,
        "wall_s": round(wall, 2),
        "conversations_per_s": round(args.conversations / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "client_cpu_s": round(cpu, 2),
        "client_cpu_ms_per_request": round(1000 * cpu / requests, 3),
        "client_requests_per_cpu_s": round(requests / cpu, 1),
        "server_cpu_ms_per_request": round(1000 * server_cpu / requests, 3),
        "output_tokens_per_s_equivalent": round(res.new_tokens / wall),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
