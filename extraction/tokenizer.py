"""Load the target's tokenizer with a clear error for a missing or broken directory."""

from __future__ import annotations

from dflash_pipeline.errors import CompatError


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise CompatError(
            f"cannot load a tokenizer from {path}: {e}. Set target.tokenizer_path to a directory with tokenizer files"
        ) from e
    if tok.chat_template is None:
        raise CompatError(f"the tokenizer in {path} has no chat_template; use the chat model's tokenizer")
    return tok


def pad_token_id(tok) -> int:
    """The id that pads a batch: the pad token, else EOS (many chat checkpoints define no pad), else 0."""
    if tok.pad_token_id is not None:
        return tok.pad_token_id
    return tok.eos_token_id if tok.eos_token_id is not None else 0
