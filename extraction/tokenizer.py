"""Load the target's tokenizer with a clear error for a missing or broken directory."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_pipeline.errors import CompatError

# What AutoTokenizer loads a vocabulary from (fast: tokenizer.json; slow: sentencepiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "merges.txt")
# Where transformers finds a chat template: tokenizer_config.json's chat_template, or a file beside it.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def check_tokenizer_dir(path: str, field: str, trust_remote_code: bool) -> None:
    """Without these files transformers still builds some tokenizer and the run failed later with 'has no
    chat_template'; name what is missing and the setting (`field`) that fixes it. The CLI's pre-flight and the
    probe (deployments skip the CLI) both call it."""
    d = Path(path)
    names = {f.name for f in d.iterdir()}
    config = d / "tokenizer_config.json"
    vocab = [n for n in names if n in TOKENIZER_FILES or n.endswith((".tiktoken", ".model"))]
    if not vocab and not trust_remote_code:
        fix = (
            "set target.tokenizer_path to the directory that has them (e.g. the original checkpoint's)"
            if field == "target.model_path"
            else "give target.tokenizer_path a directory that has them, or leave it unset to use the model's"
        )
        raise CompatError(
            f"{field} {d} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}"
            f"{', tokenizer_config.json' if 'tokenizer_config.json' not in names else ''}): {fix}"
        )
    if trust_remote_code or names & set(CHAT_TEMPLATE_FILES) or (d / "additional_chat_templates").is_dir():
        return
    try:
        has_template = bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except (OSError, ValueError, AttributeError):
        return  # transformers says what is wrong with it
    if not has_template:
        raise CompatError(
            f"the tokenizer in {d} has no chat template (no chat_template in tokenizer_config.json, no "
            f"{' or '.join(CHAT_TEMPLATE_FILES)}): it is a base model's; set target.tokenizer_path to the chat "
            "(instruct) model's tokenizer directory"
        )


def load_tokenizer(path: str, trust_remote_code: bool = False, field: str = "target.tokenizer_path"):
    from transformers import AutoTokenizer

    if Path(path).is_dir():
        check_tokenizer_dir(path, field, trust_remote_code)

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
