"""dflash-pipeline: chat data + target LLM -> validated Zarr store of hidden states -> servable DFlash drafter.

This folder (core/) is the root package `dflash_pipeline`: configuration, errors, the command line and the stage
API. The other parts are mapped in from the repository's top-level folders (see pyproject.toml and
docs/ARCHITECTURE.md). Nothing here imports Prefect.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dflash-pipeline")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

# Every module logs under this root (logging.getLogger(__name__)); tasks/ forwards it to the Prefect UI.
PACKAGE_LOGGER = __name__
