"""`dflash-pipeline verify`: check a store version completely, and with --repair discard what is proven damaged
(the command's text; the checks are storage/verify.py's). Split out of core/cli.py."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_verify(args: argparse.Namespace) -> int:
    """Check a store version completely; one line per problem, then a summary. Exit 0 healthy and validated, 1
    not, 2 the store or version cannot be read (no published version), 3 a repair could not be finished."""
    from contextlib import ExitStack

    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.storage.leases import ReaderLease
    from dflash_pipeline.storage.store import Store
    from dflash_pipeline.storage.validated import validation_status
    from dflash_pipeline.storage.verify import verify_version

    held = ExitStack()  # with --repair: the store's lock, so no run plans or extracts while units are discarded
    try:
        store = Store(args.store, json.loads(args.store_options) if args.store_options else None)
        store.check_readable()
        _not_a_version_dir(args.store, store)
        if args.repair:
            held.enter_context(store.lock(brief="verify --repair"))
        version = args.version or _published(args, store)
        if version not in store.versions():
            raise PipelineError(f"no store version {version} under {store.url} (versions: {store.versions()})")
        lease = ReaderLease(store, version)  # retention and pruning leave the version alone while it is checked
        try:
            report = verify_version(store, version, digests=not args.sizes_only, threads=args.threads)
            unvalidated = validation_status(store, version)
        finally:
            lease.release()
    except PipelineError as e:
        held.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    with held:
        return _verified(args, store, version, report, unvalidated)


def _not_a_version_dir(given: str, store) -> None:
    """`verify runs/embedded/store/v0001`: a version's directory given as the store (it holds no versions)."""
    from dflash_pipeline.errors import StoreError

    parent, _, name = given.rstrip("/").rpartition("/")
    if name.startswith("v") and store.loc.exists("zarr.json") and not store.versions():
        raise StoreError(f"{given} is a store version, not a store: did you mean {parent or '.'} --version {name}?")


def _published(args: argparse.Namespace, store) -> str:
    """CURRENT; with none, while a run holds the store's lock, an error saying that the run is writing it."""
    from dflash_pipeline.errors import StoreError
    from dflash_pipeline.storage.reader import published_version

    try:
        return published_version(
            store, "warn" if args.unvalidated else "refuse", lambda m: print(f"warning: {m}", file=sys.stderr)
        )
    except StoreError:
        writer = None if args.repair else _store_writer(store)  # --repair holds the lock itself
        if writer is None:
            raise
        raise StoreError(
            f"store {store.url} has no published version yet: a run ({writer}) is writing it; verify it once that "
            "run has validated and published a version (CURRENT), or name one: --version V --unvalidated"
        ) from None


def _store_writer(store) -> str | None:
    """What the run that holds the store's lock recorded ('pid N on HOST since T'), found as `verify --repair` finds
    it: by taking the lock for an instant (as a brief holder, which a run starting then waits for). None when no
    one holds it, or when it cannot be taken here (a store this user cannot write)."""
    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.storage.store_lock import StoreBusy

    if not store.loc.exists(".lock"):  # no run ever took it (nor is a path that is no store given a lock file)
        return None
    try:
        with store.lock(brief="verify"):
            return None
    except StoreBusy as e:
        return e.holder
    except PipelineError:  # a store this user cannot write
        return None


def _verified(args: argparse.Namespace, store, version: str, report, unvalidated: str | None) -> int:
    """verify's report, and with --repair the repair (under the store's lock)."""
    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.progress import counted
    from dflash_pipeline.storage.discard import discard_units
    from dflash_pipeline.storage.identity import same_identity
    from dflash_pipeline.storage.plan_records import rebuild_plan_records
    from dflash_pipeline.storage.validated import unvalidated_fix
    from dflash_pipeline.storage.verify import RECORD

    for p in report.problems:
        print(p.line())
    if unvalidated:
        line = f"{store.loc.url_of(version)} is not validated: {unvalidated}"
        # (unit directories swapped by hand: moved back, the version is as validated; validating it as it is would
        # publish the swapped order)
        fix = (
            "move the unit directories back (above)"
            if report.misplaced
            else unvalidated_fix(store, version, unvalidated)
        )
        print(f"warning: {line} (--unvalidated: not counted)" if args.unvalidated else f"{line}: {fix}")
    print(report.summary() + ("" if not unvalidated or args.unvalidated else "; not validated (see above)"))
    if args.repair and report.damaged_units() and not report.attributes_vouched:
        print(
            "not discarding units: the version's own attributes are damaged or unrecorded (see above), and units are "
            "checked against them. Rerun the same `run` on this store first (extract restores them from the run's "
            "provenance, or says why it cannot), then `verify --repair` again if units still fail"
        )
    elif args.repair and (report.damaged_units() or any(p.kind == RECORD for p in report.problems)):
        try:
            for line in rebuild_plan_records(store, report):
                print(line)
            damaged = report.damaged_units()
            if damaged and not store.resumable(version):
                mine = store.attrs(version)
                newest = [v for v in store.versions() if same_identity(store.attrs(v), mine)][-1]
                print(
                    f"not discarding units of {version}: a newer version of the same target, layers and precision "
                    f"exists ({newest}), and runs extract into the newest one only, so nothing would rebuild them "
                    f"here. Readers of {version} keep getting the error naming them. Repair the newest version "
                    f"instead if it shares the damage (`dflash-pipeline verify {args.store} --version {newest} "
                    "--repair`, then rerun; a nightly run repairs a version that failed validation on integrity by "
                    "itself): validation then publishes it"
                )
            elif damaged:
                discard_units(store, version, sorted(damaged), {u: why[0] for u, why in damaged.items()})
                print(
                    f"discarded {counted(len(damaged), 'damaged unit')} of {version} ({', '.join(sorted(damaged))}): "
                    "rerun the pipeline's extract stage on this store (with validate) to extract exactly their "
                    "samples again (until then `verify` exits 1, naming them); validation then moves CURRENT"
                )
        except (PipelineError, OSError) as e:
            print(f"error: repair of {store.loc.url_of(version)} stopped: {e}", file=sys.stderr)
            return 3
    if args.repair and any(p.kind == RECORD and p.unit == "-" for p in report.problems):
        print("the version record cannot be rebuilt here (it needs the run's provenance): rerun extract on this store")
    return 0 if report.ok and (not unvalidated or args.unvalidated) else 1
