"""Configuration, errors and the command line of dflash-pipeline (no Prefect imports here)."""
