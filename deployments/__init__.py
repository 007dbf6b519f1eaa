"""Prefect deployments of dflash-pipeline: prefect.yaml beside this file (shipped in the wheel)."""

from pathlib import Path

PREFECT_FILE = Path(__file__).with_name("prefect.yaml")
