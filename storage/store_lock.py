"""The store lock: one run at a time per store, waiting only for a holder that says it is brief (retention)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.leases import now_utc

if TYPE_CHECKING:
    from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)

BRIEF = "(brief)"  # in a store lock's holder: the holder will let go soon; a run may wait for it


class _Busy(Exception):
    """The store lock is taken; `holder` is what its holder recorded."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class StoreBusy(StoreError):
    """Another run holds the store's lock; `holder`: what it recorded ('pid N on HOST since T[, brief ...]')."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


@contextmanager
def hold(store: Store, brief: str | None = None, wait_for_brief_s: float = 0.0) -> Iterator[None]:
    """Exclusive use of `store` by one run (plan, extract, validate, promote), taken without waiting for
    another run. A holder that says it is `brief` (retention deleting data: seconds to minutes) is waited
    for, up to `wait_for_brief_s`, so that a nightly run does not fail because a training run was deleting
    the units its checkpoint had covered at that moment."""
    store.check_writable()
    holder = f"pid {os.getpid()} on {socket.gethostname()} since {now_utc()}" + (f", {brief} {BRIEF}" if brief else "")
    deadline, waited, held = time.monotonic() + wait_for_brief_s, False, ExitStack()
    while True:
        try:
            held.enter_context(store.loc.lock(".lock", holder, _Busy))
            break
        except _Busy as e:
            if BRIEF not in e.holder or time.monotonic() >= deadline:
                raise StoreBusy(
                    f"store {store.url} is in use by another run ({e.holder}); wait for it to finish or use "
                    "another store_path",
                    e.holder,
                ) from None
            if not waited:
                log.info("store %s: waiting for %s", store.url, e.holder)
            waited = True
            time.sleep(0.5)
    with held:
        yield
