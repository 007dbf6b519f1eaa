"""The package's log records reach the Prefect UI from inside runs only; outside one (a direct call of the logic, the
CLI's pre-flight, the unit tests) Prefect's API handler warned once per record ("attempted to send logs to the API
without a flow run id": 31 such warnings in `make unit`, found by a fresh-user check)."""

from __future__ import annotations

import logging
import warnings


def test_logic_logs_outside_a_run_warn_nothing():
    from dflash_pipeline import PACKAGE_LOGGER
    from dflash_pipeline.tasks import common  # noqa: F401 - importing the tasks adds the API handler

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logging.getLogger(f"{PACKAGE_LOGGER}.storage.store").info("a record outside any run")
    assert not [w for w in caught if "without a flow run id" in str(w.message)], [str(w.message) for w in caught]
