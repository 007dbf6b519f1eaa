"""The Prefect server under a team's load, on PostgreSQL and on SQLite: the same load as the CI test
(tests/e2e/test_postgres.py::test_twenty_runs_on_three_workers_against_postgres).

For each backend: `dflash-pipeline serve` (PostgreSQL: a throwaway cluster, fsync on, tests/pgserver.py; SQLite:
Prefect's default file under a fresh Prefect home), two more Prefect workers, then RUNS extract-only flow runs
submitted at once (tiny extractions of the embedded target, RUNS/STORES runs per store, the deployment's limit
raised to the number of workers). Prints one JSON line of figures per backend: runs, final states, wall time,
most runs running at once, runs lost or not final, database errors in the server log, failed API calls in the
workers' logs; then checks every store with `dflash-pipeline verify`. Everything it starts is stopped.

    .venv/bin/python bench/prefect_load_bench.py                       # both backends, 20 runs, 3 workers
    .venv/bin/python bench/prefect_load_bench.py --backend sqlite --runs 40 --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.pgserver / tests.serving: the harness the CI test uses

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def one(backend: str, runs: int, workers: int, stores: int) -> dict:
    from dflash_pipeline.cli import main as cli_main
    from tests.pgserver import ThrowawayPostgres
    from tests.serving import LOAD_SERVER_ENV, run_load, serve

    with tempfile.TemporaryDirectory(prefix=f"dflash-load-{backend}-") as tmp:
        tmp = Path(tmp)
        (tmp / "home").mkdir()
        pg = ThrowawayPostgres(fsync=True).start() if backend == "postgres" else None
        try:
            url = pg.create_database("prefect") if pg else None
            with serve(tmp / "home", database=url, env=LOAD_SERVER_ENV) as lp:
                r = run_load(lp, tmp / "out", runs=runs, workers=workers, stores=stores)
                startup = lp.startup_s
            figures = {"backend": backend, "serve_startup_s": round(startup, 1), **r.figures()}
            figures["verified_stores"] = sum(
                cli_main(["verify", "--sizes-only", str(s / "store")]) == 0 for s in r.stores
            )
            figures["stores"] = stores
            other = {i: m[:200] for i, m in r.failures.items() if "is in use by another run" not in m}
            if other:
                figures["other_failures"] = other
            if r.db_errors:
                figures["db_error_lines"] = r.db_errors[:5]
            if r.api_errors:
                figures["api_error_lines"] = r.api_errors[:5]
            return figures
        finally:
            if pg:
                pg.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--stores", type=int, default=10)
    args = ap.parse_args()
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )
    for backend in ["postgres", "sqlite"] if args.backend == "both" else [args.backend]:
        print(json.dumps(one(backend, args.runs, args.workers, args.stores)), flush=True)
    print(json.dumps({"load_avg_1m_after": round(os.getloadavg()[0], 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
