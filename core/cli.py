"""`dflash-pipeline` command line: run the pipeline flow (ephemeral Prefect by default)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from dflash_pipeline.verify_command import cmd_verify


def _quiet_libraries() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's 20 s default start-up limit for its temporary server runs out on a loaded 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Progress bars off through the environment (read by huggingface_hub, transformers and datasets, here and
    # in every child): importing transformers just to switch them off cost 4 s before the first check.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # torch's OpenMP threads sleep when idle instead of spinning, here and in every child (read when torch loads):
    # a spinning thread takes a core another process needs (core/threads.py has the measurements).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cmd_run(args: argparse.Namespace) -> int:
    from dflash_pipeline.config import load_config, parse_override
    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.runguard import guarded_run, raise_if_stopped

    started = time.monotonic()
    try:
        cfg = load_config(args.config, args.set)  # fail fast on a bad config, before Prefect starts
        from dflash_pipeline.preflight import prefect_home, preflight

        preflight(cfg)  # model path, layer ids, output dir: in a second, not after Prefect starts
        api = os.environ.get("PREFECT_API_URL")
        if api:  # a configured server that is down: say so now, not after a long hang
            from dflash_pipeline.local_prefect import check_api

            check_api(api)
        else:
            prefect_home()
        with guarded_run(debug=args.debug):  # SIGTERM/SIGHUP act as Ctrl-C; nothing outlives even a SIGKILL
            server = _start_temporary_server()  # its ~10-20 s start overlaps the imports below
            from prefect.exceptions import CancelledRun

            from dflash_pipeline import progress
            from dflash_pipeline.flows.pipeline import dflash_pipeline

            if server is not None:
                server.join()
            with progress.showing(progress.display_for(sys.stderr)):
                try:
                    overrides = dict(parse_override(s) for s in args.set)
                    summary = dflash_pipeline(config_path=args.config, overrides=overrides)
                except CancelledRun:
                    raise_if_stopped()  # the run ended Cancelled because we asked it to stop: say so, exit 130
                    raise
    except PipelineError as e:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # the rest is shutting down (Prefect's temporary server stops at exit): a second Ctrl-C there printed a
        # traceback from Prefect's exit handler (a fresh-user check), and stopping it would leave the server behind
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(
            f"stopped ({str(e) or 'Ctrl-C'}): what was committed (store units, training checkpoints) is kept, and "
            "running the same command again resumes from there",
            file=sys.stderr,
        )
        return 130
    except RuntimeError as e:
        if type(e).__name__ == "WorkerCrashed" and not args.debug:  # retries used up: say which worker, how
            print(f"error: {e}\nrun the same command again to resume from the last commit", file=sys.stderr)
            return 1
        if "server" not in str(e).lower() or args.debug:
            raise
        from dflash_pipeline.runguard import temporary_server_log

        print(
            f"error: Prefect's temporary server did not start ({e}; its output: {temporary_server_log()}). The "
            "machine may be busy: run again, raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now "
            f"{os.environ.get('PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS')} s), or start a server once "
            "(dflash-pipeline serve) and set PREFECT_API_URL",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, default=str))
    else:
        print("\n".join(summary_lines(summary, time.monotonic() - started)))
    return 0


def _extracted(s) -> str:
    tokens = s.tokens_extracted or 0
    if s.new_samples:
        return f"{s.new_samples:,} new samples, {tokens:,} tokens extracted now"
    if tokens:  # units planned by an earlier run: cut short, or discarded by `verify --repair`
        return (
            f"no new samples; {tokens:,} tokens of units planned before (unfinished, repaired or deleted by "
            "retention) extracted now"
        )
    return "no new samples, nothing to extract"


def summary_lines(s, seconds: float) -> list[str]:
    """The run's summary for people: what was produced, where, and the acceptance length (`--json`: all of it)."""
    from dflash_pipeline.progress import shown

    lines = [f"done in {seconds:.0f} s; outputs under {shown(s.output_dir)}"]
    if s.current or s.version:
        what = f"{_extracted(s)}; " if s.version else ""
        published = f"; CURRENT is {s.current or 'not set'}" if s.version and s.current != s.version else ""
        # the reader's default reads it: published, not failed, its data not deleted by retention (a fresh-user check)
        readable = (s.version or s.current) == s.current and s.validation != "FAIL" and not s.bytes_freed
        lines.append(
            f"store: {shown(s.store)} version {s.version or s.current} ({what}validation {s.validation or 'not run'}"
            f"{published})"
            + ("; read it with dflash_pipeline.storage.reader.HiddenStateDataset (docs/STORE.md)" if readable else "")
        )
    if s.retention:
        lines.append(s.retention)
    if s.pruned:  # (extract.keep_versions: the run-summary artifact says so too)
        lines.append(f"pruned older store versions: {', '.join(s.pruned)} (extract.keep_versions)")
    if s.drafter:
        lines.append(f"drafter: {shown(s.drafter)}" + (f" (final loss {s.final_loss:.3f})" if s.final_loss else ""))
    if s.acceptance_length is not None:
        base = s.untrained_acceptance_length
        lines.append(
            f"acceptance length {s.acceptance_length:.2f} tokens per target step"
            + (f" (untrained drafter: {base:.2f})" if base is not None else "")
        )
    for f, taus in (s.acceptance_by or {}).items():  # evaluate.slice_by: the whole table is the evaluate artifact's
        lines.append(f"acceptance length by {f}: " + ", ".join(f"{v} {t:.2f}" for v, t in taus.items()))
    if s.reused:
        lines.append(f"reused from earlier runs: {', '.join(s.reused)}")
    return lines


def _start_temporary_server():
    """Start Prefect's temporary server on a thread now (a thread the caller joins before the flow starts), so that
    its start (a fresh database's migrations: 10-20 s on 2 cores) overlaps importing torch, transformers and the
    flow. None with a configured server (PREFECT_API_URL). A failure here is left to the flow, which starts the
    server again and reports it."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    import threading

    def start() -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - the flow's own start says what went wrong
            pass

    thread = threading.Thread(target=start, name="prefect-server-start", daemon=True)
    thread.start()
    return thread


def cmd_plan(args: argparse.Namespace) -> int:
    """The pre-flight plan (core/planner.py): samples and tokens kept, store size, GPU-hours, room on the disk.
    Exit 0 when the store fits and the run would start, 1 when it does not fit or would be refused, 2 on a user
    error."""
    from dflash_pipeline.config import load_config
    from dflash_pipeline.errors import PipelineError

    try:
        cfg = load_config(args.config, args.set)
        from dflash_pipeline.planner import REFUSED
        from dflash_pipeline.preflight import preflight, store_precision_refusal

        preflight(cfg, what_if=True)
        from dflash_pipeline import stages

        cfg = stages.resolve_paths(cfg)
        report = stages.probe(cfg)
        regenerated = cfg.regenerate.enabled and cfg.regenerated_path.is_file()
        if regenerated:  # an earlier run's replies: what a run prepares and extracts (it adds any missing first)
            cfg = cfg.model_copy(update={"data": stages.regenerated_data(cfg)})
        prepared = stages.prepare(cfg, report)  # written under output_dir/prepared: `run` reuses it
        est = stages.estimate(cfg, report, prepared)
        if prepared.quarantined:  # (a fresh-user check: `run` names the file, `plan` did not)
            where = prepared.quarantine_path
            est.notes.append(f"{prepared.quarantined:,} rows quarantined, each with its reason in {where}")
        if refusal := store_precision_refusal(cfg):
            est.notes.insert(0, f"{REFUSED}{refusal}")
        if regenerated:
            est.notes.insert(
                0,
                f"regenerate is on: the figures count the replies already regenerated in {cfg.regenerated_path} "
                "(a run first regenerates any conversation that file lacks)",
            )
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a fresh-user check: a 56-line traceback, and no exit status of a stop)
        print("stopped (Ctrl-C): the plan changed nothing in the store", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print("\n".join(est.lines()))
    if not est.fits:
        hint = "run refuses to start" if cfg.plan.disk_check else "plan.disk_check=false: run would start anyway"
        print(f"the store does not fit ({hint})", file=sys.stderr)
    refused = any(n.startswith(REFUSED) for n in est.notes)
    if refused:  # (a fresh-user check: `plan && run` went on into the refusal)
        print("a run with these settings will be refused (see the note above)", file=sys.stderr)
    return 0 if est.fits and not refused else 1


def cmd_build_default(args: argparse.Namespace) -> int:
    from dflash_pipeline.embedded.build import ensure_built
    from dflash_pipeline.errors import PipelineError

    try:
        print(ensure_built())
    except PipelineError as e:  # a DFLASH_HOME that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.runguard import ensure_guard
    from dflash_pipeline.serve import serve

    ensure_guard()  # a SIGKILL of serve runs no handler: the guard then stops its server, worker and their runs
    try:
        return serve(args.port, args.home, database=args.database, host=args.host)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_show_config(args: argparse.Namespace) -> int:
    from dflash_pipeline.config import defaults_yaml, load_config
    from dflash_pipeline.errors import ConfigError

    try:
        cfg = load_config(args.config, args.set) if args.config or args.set else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(defaults_yaml(cfg), end="")
    return 0


def cmd_export_states(args: argparse.Namespace) -> int:
    """A validated store version in another trainer's offline layout (storage/export_states.py, docs/INTEROP.md)."""
    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.storage.export_states import export_states

    try:
        opts = json.loads(args.store_options) if args.store_options else None
        export_states(args.store, args.out, args.format, args.version, args.dtype, args.restart, opts)
    except (PipelineError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_import_drafter(args: argparse.Namespace) -> int:
    """A drafter trained by another trainer in our export format (drafter/import_speculators.py, docs/INTEROP.md)."""
    from dflash_pipeline.drafter.import_speculators import import_speculators

    try:
        out = import_speculators(args.checkpoint, args.out, args.target, args.epoch)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive number")
    return n


class _PlainLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno <= logging.INFO else f"{record.levelname}: {text}"


def _console_logging(args: argparse.Namespace) -> None:
    """`run`: one progress display (core/progress.py) and, on the console, warnings and errors only (every record
    with --verbose); the records still reach the Prefect UI. `plan`: warnings only (its report is its output).
    Other commands: every INFO record, as lines."""
    from dflash_pipeline.progress import ConsoleHandler, hide_gpu_notes_without_gpu

    hide_gpu_notes_without_gpu()  # transformers' notes on missing GPU kernels, on a machine without a GPU
    if args.command == "run":
        logging.basicConfig(level=logging.INFO, handlers=[ConsoleHandler(verbose=args.verbose)])
    else:  # plain lines like run's: an INFO record as its message, a warning or error as "LEVEL: message"
        handler = logging.StreamHandler()
        handler.setFormatter(_PlainLines())
        if args.command == "plan":
            handler.setLevel(logging.WARNING)  # its report is the output; the stages' INFO lines are for the UI
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    for noisy in ("httpx", "httpcore", "uvicorn", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/unit/test_readme.py parses the README's commands with it)."""
    from dflash_pipeline import __version__

    parser = argparse.ArgumentParser(prog="dflash-pipeline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run the pipeline (probe, regenerate, prepare, plan, extract, validate, train, evaluate)"
    )
    run.add_argument("--config", help="YAML config file (see configs/default.yaml)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set data.max_samples=100 (repeatable)",
    )
    run.add_argument("--debug", action="store_true", help="show tracebacks (Prefect's and ours) for user errors")
    run.add_argument("--json", action="store_true", help="print the run's summary as JSON (stdout), nothing else")
    run.add_argument(
        "-v", "--verbose", action="store_true", help="every log line on the console (default: stages and warnings)"
    )
    run.set_defaults(fn=cmd_run)
    pl = sub.add_parser(
        "plan",
        help="pre-flight plan of a run (same config as run): samples and tokens kept, store size, GPU-hours, disk room",
    )
    pl.add_argument("--config", help="YAML config file (see configs/default.yaml)")
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    pl.add_argument("--json", action="store_true", help="print the figures as JSON")
    pl.set_defaults(fn=cmd_plan)
    b = sub.add_parser("build-default", help="build the embedded tiny target and tokenizer, print its path")
    b.set_defaults(fn=cmd_build_default)
    sv = sub.add_parser(
        "serve", help="local Prefect server + work pool + deployments + worker (Ctrl-C, SIGTERM, SIGHUP stop it)"
    )
    sv.add_argument("--port", type=int, default=4200, help="the Prefect server's port (default 4200)")
    sv.add_argument(
        "--home",
        help="Prefect's home (its SQLite database, and serve's logs); default $PREFECT_HOME or ~/.prefect, logs then "
        "under ./runs/logs",
    )
    sv.add_argument(
        "--database",
        metavar="URL",
        help="the server's PostgreSQL database, postgresql://USER:PASSWORD@HOST:PORT/DB (needs the [postgres] extra); "
        "default $PREFECT_SERVER_DATABASE_CONNECTION_URL, else SQLite under the Prefect home",
    )
    sv.add_argument(
        "--host", default="127.0.0.1", help="the server's address: 0.0.0.0 lets workers on other machines connect"
    )
    sv.set_defaults(fn=cmd_serve)
    sc = sub.add_parser(
        "show-config", help="print the configuration, documented, as YAML: the defaults, or what --config/--set make"
    )
    sc.add_argument("--config", help="YAML config file (see configs/default.yaml)")
    sc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    sc.set_defaults(fn=cmd_show_config)
    vf = sub.add_parser("verify", help="check a store version: every committed file, digest and attribute")
    vf.add_argument("store", help="the store path (or s3://bucket/prefix)")
    vf.add_argument("--version", help="the version to check (default: CURRENT, the published version)")
    vf.add_argument("--sizes-only", action="store_true", help="check presence and sizes, not digests (fast)")
    vf.add_argument(
        "--repair",
        action="store_true",
        help="rewrite damaged plan records from the committed attributes, discard damaged units; a rerun of extract "
        "redoes them",
    )
    vf.add_argument(
        "--unvalidated",
        action="store_true",
        help="check a version that did not pass validation (or, with no CURRENT, the newest): a warning, not a failure",
    )
    vf.add_argument("--threads", type=_positive_int, default=4, help="units checked at once (default 4)")
    vf.add_argument("--store-options", help='JSON of an s3:// store\'s options, e.g. \'{"endpoint_url": "..."}\'')
    vf.set_defaults(fn=cmd_verify)
    ex = sub.add_parser(
        "export-states",
        help="write a validated store version in another trainer's offline layout (speculators: docs/INTEROP.md)",
    )
    ex.add_argument("store", help="the store path (or s3://bucket/prefix)")
    ex.add_argument("out", help="the export directory (new, or an earlier export of the same version to continue)")
    ex.add_argument("--format", default="speculators", choices=["speculators"], help="the layout (default speculators)")
    ex.add_argument("--version", help="the version to export (default: CURRENT); it must have passed validation")
    ex.add_argument(
        "--dtype",
        default="store",
        choices=["store", "bfloat16", "float16", "float32"],
        help="dtype of the hidden states written (default: the store's logical dtype)",
    )
    ex.add_argument("--restart", action="store_true", help="OUT holds another export: delete its files and start over")
    ex.add_argument("--store-options", help='JSON of an s3:// store\'s options, e.g. \'{"endpoint_url": "..."}\'')
    ex.set_defaults(fn=cmd_export_states)
    im = sub.add_parser(
        "import-drafter",
        help="convert a DFlash drafter trained by speculators into this project's export format (docs/INTEROP.md)",
    )
    im.add_argument("checkpoint", help="a speculators checkpoint directory, or its --save-path (the last epoch)")
    im.add_argument("out", help="the export directory to write (replaced if it exists)")
    im.add_argument("--target", help="the target model's directory (default: the verifier path the checkpoint records)")
    im.add_argument("--epoch", help="with a --save-path: the epoch directory to take (a number, or checkpoint_best)")
    im.add_argument("--format", default="speculators", choices=["speculators"], help="the checkpoint's trainer")
    im.set_defaults(fn=cmd_import_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _console_logging(args)
    _quiet_libraries()
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a traceback nothing can catch
        return rc
    except BrokenPipeError:  # the reader of our output left (`verify ... | head -1`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush would fail on the closed pipe again
        return 141


if __name__ == "__main__":
    sys.exit(main())
