"""The embedded default: bundled conversations, held-out prompts, and a tiny hybrid target built on
first use (see build.py). `resolve_*` map the config value 'embedded' to real paths."""

from __future__ import annotations

from pathlib import Path

EMBEDDED = "embedded"
SHIPPED_TARGET = Path(__file__).parent / "data" / "target"  # the shipped weights and their config.json


def resolve_source(source: str) -> str:
    if source == EMBEDDED:
        from dflash_pipeline.embedded.build import CONVERSATIONS

        return str(CONVERSATIONS)
    return source


def resolve_model(path: str) -> str:
    if path == EMBEDDED:
        from dflash_pipeline.embedded.build import ensure_built

        return str(ensure_built())
    return str(Path(path).expanduser())


def heldout_prompts() -> Path:
    from dflash_pipeline.embedded.build import HELDOUT_PROMPTS

    return HELDOUT_PROMPTS
