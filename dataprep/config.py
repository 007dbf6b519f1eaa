"""The data section of the run's configuration (core/config.py composes RunConfig from it), kept beside the code
that reads it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from dflash_pipeline.base import Section


class DataConfig(Section):
    source: str = Field(
        "embedded",
        description="'embedded', a local .jsonl/.json/.parquet/.arrow file, a directory "
        "saved by `datasets`, or a HF dataset name (needs hub access).",
    )
    format: Literal["auto", "sharegpt", "messages", "ultrachat"] = Field(
        "auto",
        description="Row schema; 'auto' decides per row from the field that holds a value (conversations, "
        "messages or data), so unified schemas with nulls work.",
    )
    split: str = Field("train", description="Split to read from a HF dataset / DatasetDict directory.")
    max_samples: int | None = Field(
        None,
        ge=1,
        description="Keep only the first N usable samples (quick runs). With the regenerate stage only the first N "
        "rows are regenerated, and exact duplicates among their new replies are dropped: fewer than N may remain.",
    )
    max_length: int = Field(2048, ge=8, description="Token limit per sample.")
    overlength: Literal["drop", "truncate"] = Field("drop", description="What to do with longer samples.")
    min_supervised_tokens: int = Field(2, ge=1, description="Drop samples with fewer assistant tokens.")
    mask_turns: Literal["all", "last"] = Field("all", description="Supervise every assistant turn or the last.")
    rows_per_shard: int = Field(50_000, ge=1, description="Rows per Arrow file of the prepared dataset.")
    encoding: str = Field(
        "auto",
        description="Text encoding of a .jsonl/.json source, e.g. 'utf-8', 'latin-1', 'cp1252'. 'auto': a byte-order "
        "mark decides (UTF-8/16/32), else UTF-8; a file none of whose non-ASCII lines is UTF-8 stops with an error "
        "naming the byte and this setting (no code page is guessed). Undecodable lines in UTF-8 text are "
        "quarantined with their byte offset.",
    )
    reasoning: Literal["supervise", "mask", "drop"] = Field(
        "supervise",
        description="Assistant reasoning (reasoning_content / reasoning fields, or an inline <think> block): "
        "'supervise' it as the template renders it, 'mask' it (rendered, not trained on), or 'drop' it before "
        "rendering.",
    )
    control_tokens: Literal["plain_text", "quarantine"] = Field(
        "plain_text",
        description="Special-token text written inside a message (a pasted '<|im_end|>'): 'plain_text' tokenizes "
        "it as ordinary text, 'quarantine' rejects the row naming the token and the message. Template markup always "
        "stays special.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        {},
        description="Extra arguments for the chat template, e.g. {enable_thinking: false, preserve_thinking: true, "
        "tools: [...]} (a row's own 'tools' field wins over tools given here).",
    )

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, v: str) -> str:
        import codecs

        if v != "auto":
            try:
                codecs.lookup(v)
            except LookupError:
                raise ValueError(
                    f"data.encoding {v!r} is not a text encoding Python knows; use 'auto', 'utf-8', 'latin-1', "
                    "'cp1252', ..."
                ) from None
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = {"messages", "conversation", "tokenize", "add_generation_prompt", "continue_final_message"}
        reserved |= {"return_dict", "return_assistant_tokens_mask", "chat_template", "documents"}
        for k in v:
            if k in reserved:
                raise ValueError(f"data.chat_template_kwargs.{k} is set by the pipeline itself; remove it")
        try:
            json.dumps(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"data.chat_template_kwargs must hold plain values (YAML/JSON): {e}") from None
        return v
