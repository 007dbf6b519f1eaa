"""How `dflash-pipeline run` stops, and what it leaves behind: nothing.

- SIGTERM (and SIGHUP) are turned into KeyboardInterrupt, so they take the same path as Ctrl-C: the flow stops
  its extraction workers (extraction/procs.py: SIGTERM, SIGKILL of their process groups after STOP_GRACE_S)
  and Prefect's temporary server (a uvicorn child) is stopped by its exit handler.
- A stop is also remembered: the KeyboardInterrupt is raised wherever the main thread happens to be when the
  signal arrives, and a library can drop it there (an exception raised inside a finalizer is only printed; a
  Ctrl-C was lost that way once, and the run went on to the end). The flow calls `raise_if_stopped` while it waits
  for its extraction workers (every STOP_POLL_S), before each stage and after the last; a stage that runs in this
  process (prepare, validate, training) is interrupted by the KeyboardInterrupt itself, and a dropped one is seen
  when that stage ends. Inside a flow run Prefect puts its own SIGTERM handler in place (it raises
  TerminationSignal); `stops_remembered` records a SIGTERM before that handler acts. Only the CLI's run is
  guarded: a flow run started by a Prefect worker stops the way Prefect stops it, and also when that worker dies
  (`watch_worker`: it gets SIGTERM, as from a cancel, and ends Crashed).
- SIGKILL runs no handler at all. Extraction workers notice their parent's death on their own
  (extraction/worker_main.py); for everything else the run started (Prefect's temporary server above all) a
  small guard process watches this one: it remembers this process's descendants and, when this process is
  gone, stops those still running (SIGTERM, SIGKILL after GUARD_GRACE_S).
- Prefect logs a user error's traceback (twice) before the CLI prints the message; without --debug those
  records keep their message and lose the traceback (also for a crashed extraction worker, whose message names
  the worker, its pid and its signal), and the console (not the UI) leaves out every Prefect line that repeats
  the message the CLI prints, and the 'Crash detected!' / 'Finished in state Crashed' lines of a stop: the CLI
  prints each error once, and a stop as its one stop message.

`python -m dflash_pipeline.runguard PID` is the guard; it imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

GUARD_GRACE_S = 5.0
GUARD_POLL_S = 0.5
_guard: subprocess.Popen | None = None


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_guarding = False  # inside guarded_run
_stop: str | None = None  # the signal that asked this run to stop, once one has (guarded_run resets it)


def _raise_interrupt(signum, frame) -> None:
    global _stop
    if _done:  # (Prefect's SIGTERM handler, left at the flow run's end, hands it back here)
        _note_late(signum, frame)
        return
    _stop = signal.Signals(signum).name
    if signum != signal.SIGINT:
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM or SIGHUP ends the process at once
    raise _interrupt()


def _interrupt() -> KeyboardInterrupt:
    return KeyboardInterrupt("" if _stop == "SIGINT" else _stop)  # the CLI says "stopped (Ctrl-C)" for ""


_done = False  # the CLI's run finished its work (flows/pipeline.py, "pipeline done"; guarded_run resets it)
_late: str | None = None  # a stop signal that came after that: it had nothing to stop
LATE_NOTE = (
    "{what} came after the run had completed: nothing was stopped; the run's results are kept (its summary is above)"
)


def run_done() -> None:
    """In the CLI's run, once its work is done and about to be reported ("pipeline done"): a stop signal from here on
    (while Prefect records the run's end, while its temporary server stops at exit) has nothing left to stop. The
    first is noted, and the CLI ends as the completed run it is (exit 0), saying so in one line; a second ends the
    process at once, also with exit 0 (the guard stops the temporary server). Before, SIGTERM there killed the CLI
    with no message, and Ctrl-C printed a traceback from Prefect's exit handler. Outside a CLI run: nothing."""
    global _done
    if not _guarding:
        return
    _done = True
    if threading.current_thread() is threading.main_thread():
        for s in _STOP_SIGNALS:  # (Prefect's SIGTERM handler of the flow run included: it restores ours at its end)
            signal.signal(s, _note_late)


def _late_what(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _note_late(signum, frame) -> None:
    global _late
    if _late is None:
        _late = _late_what(signum)
        return
    _say_late()  # a second one: the user wants out now; the run is complete, the guard stops the server
    os._exit(0)


def _say_late() -> None:
    """At exit (after Prefect's temporary server stopped: registered before its exit handler, so run after it)."""
    global _late
    if _late is not None:
        what, _late = _late, None
        try:
            sys.stdout.flush()
            print(LATE_NOTE.format(what=what), file=sys.stderr, flush=True)
        except (OSError, ValueError):  # a closed console: nothing to say it on
            pass


def raise_if_stopped() -> None:
    """Raise the KeyboardInterrupt of a stop signal again, in case the one its handler raised was dropped."""
    if _stop is not None:
        raise _interrupt()


def stop_asked() -> str | None:
    """What the CLI's stop signal says ("" for Ctrl-C, "SIGTERM", "SIGHUP"), or None if no stop was asked."""
    return None if _stop is None else str(_interrupt())


@contextmanager
def stops_remembered():
    """In a guarded run's main thread: a SIGTERM is recorded, then handed to the handler in place (inside a flow run,
    Prefect's). In a flow run a Prefect worker started: the run stops when that worker dies (`watch_worker`)."""
    if not _guarding and threading.current_thread() is threading.main_thread():
        watch_worker()
    if not _guarding or threading.current_thread() is not threading.main_thread():
        yield
        return
    inner = signal.getsignal(signal.SIGTERM)

    def record(signum, frame) -> None:
        global _stop
        _stop = _stop or signal.Signals(signum).name
        if callable(inner):
            inner(signum, frame)
        else:  # SIG_DFL or SIG_IGN: what it does, done by the kernel
            signal.signal(signum, inner)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, record)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is record:
            signal.signal(signal.SIGTERM, inner)


WORKER_POLL_S = 0.2
_watching: int | None = None  # the worker pid watch_worker watches


def watch_worker() -> None:
    """In a flow-run process a Prefect worker started (PREFECT__FLOW_RUN_ID): when the worker dies, whatever killed
    it, send this process SIGTERM, as a cancel does (Prefect's handler ends the run Crashed and reports it; the flow
    stops its extraction workers). The flow-run process is in a session of its own, so nothing else reaches it: a
    SIGKILLed worker left it running unsupervised. A thread polls the parent pid (the kernel's parent-death signal
    follows the worker's thread that spawned the process, which may end while the worker lives)."""
    global _watching
    parent = os.getppid()
    if not os.environ.get("PREFECT__FLOW_RUN_ID") or _watching == parent or parent == 1:
        return
    _watching = parent

    def poll() -> None:
        while _watching == parent:
            time.sleep(WORKER_POLL_S)
            if os.getppid() != parent:
                global worker_end
                worker_end = exit_of(parent)  # (read now: its parent, serve, reaps it within a second)
                # Our stdout and stderr were pipes to the worker, and nothing reads them now: a console write there
                # raised SystemExit (rich's console, on BrokenPipeError) wherever it happened, this thread included,
                # before the SIGTERM below. The console is gone; the API's log handler goes on.
                _silence_console()
                os.kill(os.getpid(), signal.SIGTERM)
                logging.getLogger("dflash_pipeline").error(
                    "the Prefect worker (pid %d) that started this flow run is gone%s: stopping the run",
                    parent,
                    f" ({worker_end})" if worker_end else "",
                )
                return

    threading.Thread(target=poll, name="watch-worker", daemon=True).start()


def _silence_console() -> None:
    """Point stdout and stderr at /dev/null where they are pipes (to the worker, their reader, gone); a file or a
    terminal stays."""
    import stat

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


worker_end: str | None = None  # how the worker watch_worker saw die ended ("SIGKILL", "exit 1"), if it could tell


def exit_of(pid: int) -> str | None:
    """How a process that has ended but is not yet reaped (a zombie) ended: "SIGKILL", "exit 1"; None when that
    cannot be told (reaped already, or not Linux). The last field of /proc/PID/stat is its wait status."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[-1])
    sig = status & 0x7F
    try:
        return signal.Signals(sig).name if sig else f"exit {status >> 8}"
    except ValueError:
        return f"signal {sig}"


def _user_error(exc: BaseException | None) -> bool:
    from dflash_pipeline.errors import PipelineError

    return isinstance(exc, PipelineError) or type(exc).__name__ == "WorkerCrashed"  # both say what happened


class _UserErrorLine(logging.Filter):
    """Prefect's record of a user error keeps its line (which says what is wrong and the fix) and loses the
    traceback; any other exception keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _user_error(record.exc_info[1] if record.exc_info else None):
            record.exc_info, record.exc_text = None, None
        return True


class _NoUserErrorTraceback(_UserErrorLine):
    """The CLI's: as _UserErrorLine, the error remembered as one the CLI prints (`reported`), and Prefect's
    "Encountered exception" line of any exception dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if _user_error(exc):
            reported(exc)
        super().filter(record)
        return "Encountered exception during execution" not in record.getMessage() or exc is None


def quiet_user_errors() -> None:
    """For a flow run the CLI does not guard (a deployment's, in the process a Prefect worker started for it): a
    user error is one line in the worker's log and the UI, not a traceback through Prefect's engine. Stays for the
    process (Prefect logs the flow's failure after the flow function has returned); added once."""
    if _guarding:
        return
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _UserErrorLine) for f in lg.filters):
            lg.addFilter(_UserErrorLine())


_reported: set[str] = set()  # the start of each error the CLI prints itself (seen by _NoUserErrorTraceback)


def reported(exc: BaseException) -> None:
    """`exc` ends the run and the CLI prints it: the console leaves out Prefect's lines that repeat it. Also called
    by a task's retry condition that refuses to retry a user error: Prefect then logs no record with the exception
    before the task's 'Finished in state Failed(...)' (tasks/common.py)."""
    text = str(exc)
    _reported.update(t[:80] for t in (text, repr(text)[1:-1]) if len(t) >= 8)


# Prefect's lines of a stop: the flow's crash, and the extraction task's failure with the WorkerStopped the stop
# raised (its "Finished in state Failed(...)" comes without the exception record _NoUserErrorTraceback would see)
_STOP_CRASHES = (
    "Execution was aborted by an interrupt signal",
    "Execution was aborted by a termination signal",
    "exception WorkerStopped:",
    "`dflash-pipeline run` stopped (",  # the flow's own Cancelled state of a stop (flows/pipeline.py)
)


class _ConsoleOnce(logging.Filter):
    """On the CLI's console only (the handlers of the root logger; the UI's APILogHandler keeps every record):
    Prefect's lines about an error the CLI then prints itself (a user error, a crashed worker: 'Task run failed
    with exception', the task's and the flow's 'Finished in state Failed(...)', each repeating the message), and
    its 'Crash detected!' and 'Finished in state Crashed' lines of a stop (Ctrl-C, SIGTERM: the CLI says it
    stopped). A real crash (any other exception) is still shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        msg = record.getMessage()
        return not any(s in msg for s in _STOP_CRASHES) and not any(t in msg for t in _reported)


SERVER_LOG_BYTES = 1 << 20  # past this, the log moves to temporary-server.log.1 (replacing it) at the next start


def temporary_server_log() -> Path:
    """Where the output of Prefect's temporary server goes: temporary-server.log under Prefect's home, beside the
    server's database; each start appends a line naming the run's pid and port."""
    from prefect.settings import PREFECT_HOME

    return Path(PREFECT_HOME.value()).expanduser() / "temporary-server.log"


def _open_server_log(port: int | None):
    log = temporary_server_log()
    if log.exists() and log.stat().st_size > SERVER_LOG_BYTES:
        os.replace(log, log.with_name(log.name + ".1"))
    out = open(log, "ab")  # appended: runs sharing Prefect's home, and a start Prefect retries on another port
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    out.write(f"--- {stamp} temporary server of pid {os.getpid()} on port {port}\n".encode())
    out.flush()
    return out


def isolate_ephemeral_server() -> None:
    """Start Prefect's temporary server (a uvicorn child) in a session of its own. A terminal's Ctrl-C goes to
    the whole foreground process group: the server would die at once, and the run could then neither report its
    end nor stop in time. Its own session keeps it up until this process stops it at exit; the guard stops it
    after a SIGKILL. Its output goes to temporary_server_log(), not to the run's console: uvicorn's shutdown at the
    run's end can cancel a database rollback midway, and sqlalchemy then prints a harmless traceback after the
    run's summary. (Wraps the private SubprocessASGIServer._run_uvicorn_command; without it, nothing changes.)"""
    try:
        from prefect.server.api import server as prefect_server
    except ImportError:
        return
    cls = getattr(prefect_server, "SubprocessASGIServer", None)
    original = getattr(cls, "_run_uvicorn_command", None)
    if original is None or getattr(original, "_own_session", False):
        return

    def run_uvicorn(self):
        popen = subprocess.Popen

        def in_own_session(*args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            try:
                out = _open_server_log(self.port)
            except OSError:  # the log cannot be written: the console it is, as before
                return popen(*args, **kwargs)
            with out:  # the child keeps its own copy of the descriptor
                kwargs.setdefault("stdout", out)
                kwargs.setdefault("stderr", subprocess.STDOUT)
                return popen(*args, **kwargs)

        prefect_server.subprocess.Popen = in_own_session
        try:
            return original(self)
        finally:
            prefect_server.subprocess.Popen = popen

    run_uvicorn._own_session = True
    cls._run_uvicorn_command = run_uvicorn


@contextmanager
def guarded_run(debug: bool = False):
    """The CLI's run: signals as Ctrl-C (and remembered), a guard process for SIGKILL, no traceback for user
    errors."""
    global _stop, _guarding, _done, _late
    _stop, _guarding, _done, _late = None, True, False, None
    previous = {s: signal.signal(s, _raise_interrupt) for s in _STOP_SIGNALS}
    _register_late_note()
    ensure_guard()
    if not os.environ.get("PREFECT_API_URL"):
        isolate_ephemeral_server()
    flt, console = _NoUserErrorTraceback(), _ConsoleOnce()
    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    consoles = [h for h in logging.getLogger().handlers if not isinstance(h, _api_handler_types())]
    _reported.clear()
    if not debug:
        for lg in loggers:
            lg.addFilter(flt)
        for h in consoles:
            h.addFilter(console)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)
        for h in consoles:
            h.removeFilter(console)
        for s, h in previous.items():  # a completed run keeps noting late stop signals, until the process ends
            signal.signal(s, _note_late if _done else h)
        _stop, _guarding = None, False


_late_note_registered = False


def _register_late_note() -> None:
    """Once per process, before Prefect's temporary server registers its stop at exit: exit handlers run last
    registered first, so the note on a late stop signal (run_done) comes after the server's stop."""
    global _late_note_registered
    if not _late_note_registered:
        import atexit

        atexit.register(_say_late)
        _late_note_registered = True


def _api_handler_types() -> tuple[type, ...]:
    try:
        from prefect.logging.handlers import APILogHandler
    except ImportError:
        return ()
    return (APILogHandler,)


def ensure_guard() -> None:
    """Start this process's guard once. The module keeps the handle: its stdin pipe closes when this process
    ends (after the exit handlers), which tells the guard to stop what is left."""
    global _guard
    _guard = _guard or start_guard()


PR_SET_PDEATHSIG = 1


def parent_death_signal(parent: int, sig: int):
    """A `preexec_fn` (it runs in the child between fork and exec): the kernel sends the child `sig` when the
    thread that started it dies, whatever killed it. No polling gap, unlike the guard, which learns of new
    processes every GUARD_POLL_S; the child's own children are still the guard's to stop."""

    def arm() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the guard alone
            return
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def start_guard() -> subprocess.Popen | None:
    if not Path("/proc/self/stat").exists():  # the guard reads /proc (Linux)
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.runguard", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a terminal's Ctrl-C must not end the guard before the run
    )


# ---- the guard process ----------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None for a gone one or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):  # exited, unless other threads of it still run
        try:
            if len(os.listdir(f"/proc/{pid}/task")) <= 1:
                return None
        except OSError:
            return None
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    table = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d)))}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = table[c][1]
                todo.append(c)
    return out


def _still(known: dict[int, int]) -> list[int]:
    return [p for p, start in known.items() if (st := _stat(p)) and st[1] == start]


def guard(parent: int) -> None:
    me = os.getpid()
    known: dict[int, int] = {}
    while True:
        known.update({p: s for p, s in _descendants(parent).items() if p != me})
        known = {p: s for p, s in known.items() if p in _still({p: s})}
        ready, _, _ = select.select([sys.stdin], [], [], GUARD_POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 1024):
            break  # the parent closed its end or died
        if _stat(parent) is None:
            break
    left = _still(known)
    for p in left:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GUARD_GRACE_S
    while (left := _still({p: known[p] for p in left})) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    guard(int(sys.argv[1]))
