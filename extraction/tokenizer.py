"""Load the target's tokenizer with a clear error for a missing or broken directory."""

from __future__ import annotations

from dflash_pipeline.errors import CompatError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise CompatError(
            f"cannot load a tokenizer from {path}: {e}. Set target.tokenizer_path to a directory with tokenizer files"
        ) from e
    if tok.chat_template is None:
        raise CompatError(f"the tokenizer in {path} has no chat_template; use the chat model's tokenizer")
    return tok
