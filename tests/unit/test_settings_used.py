"""Every config field is read somewhere: a setting that is accepted and then silently dropped (as
target.trust_remote_code once was) fails here, naming the field."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, Field

from dflash_pipeline.base import Section
from dflash_pipeline.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("core", "dataprep", "drafter", "embedded", "extraction", "flows", "storage", "tasks")
# Where fields are declared, not read.
DECLARATIONS = {ROOT / d / "config.py" for d in ("core", "dataprep", "drafter", "extraction")}


def package_source() -> str:
    files = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p not in DECLARATIONS]
    return "\n".join(p.read_text() for p in files)


def unread_fields(model: type[BaseModel], source: str, prefix: str = "") -> list[str]:
    """Dotted names of the fields of `model` (recursively) that no code in `source` reads as an attribute
    (`.name`) or by key (`"name"`)."""
    unread = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{info.alias or name}"
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not re.search(rf"\.{name}\b", source):
                unread.append(dotted)
            unread += unread_fields(sub, source, dotted + ".")
        elif not re.search(rf"\.{name}\b|[\"']{name}[\"']", source):
            unread.append(dotted)
    return unread


def test_every_setting_is_read_by_the_code():
    assert unread_fields(RunConfig, package_source()) == []


def test_the_check_finds_a_setting_nobody_reads():
    class Extra(Section):
        nobody_reads_this_setting: int = Field(0, description="added, and forgotten")

    class Config(RunConfig):
        extra: Extra = Field(Extra(), description="a new section")

    assert unread_fields(Config, package_source()) == ["extra", "extra.nobody_reads_this_setting"]
