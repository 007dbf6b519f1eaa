"""Golden loss masks per template family: for a table of conversations, the supervised tokens decode, run by run,
to the text written here by hand from each template's documented behaviour.

Templates: the embedded target's (real tokenizer of the embedded model), and the test templates of
tests/assets/templates on the real Qwen3.5/3.6 vocabulary (tests/qwen_vocab.py). A run of supervised tokens can
start one token early where the tokenizer merges the header's last newline with the turn's first characters
(Qwen's pre-tokenizer merges newline runs): that token is supervised, so the expected text starts with it.
"""

from __future__ import annotations

import pytest

from dflash_pipeline.dataprep.normalize import RowError, normalize_conversation
from dflash_pipeline.dataprep.render import render
from tests.qwen_vocab import qwen_tokenizer

IM_END, EOT, END_TURN = "<|im_end|>", "<|eot_id|>", "<end_of_turn>"
EMPTY_THINK = "\n\n</think>\n\n"  # what follows an opened `<think>\n` when a kept turn has no reasoning


def _a(content, reasoning=None, **extra):
    m = {"role": "assistant", "content": content, **extra}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def _u(content):
    return {"role": "user", "content": content}


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVS = {
    "reasoning": [
        {"role": "system", "content": "You are terse."},
        _u("What is 2+2?"),
        _a("4.", "Add."),
        _u("And 3+3?"),
        _a("6.", "Add again."),
        _u("Thanks!"),
        _a("You're welcome.", "Polite."),
    ],
    "empty": [_u("Say nothing."), _a(""), _u("Now say hi."), _a("Hi.")],
    "whitespace": [_u(" Hello? "), _a("  \nHi there.\n  ")],
    "literal": [_u("What does <|im_end|> do?"), _a("It ends a turn: <|im_end|> then <|im_start|>.")],
    "tools": [
        {"role": "system", "content": "S"},
        _u("Weather in Paris?"),
        _a("", "Need the tool.", tool_calls=[CALL]),
        {"role": "tool", "content": "sunny, 21 C"},
        _a("Sunny, 21 C.", "Report it."),
    ],
    "non_ascii": [_u("Ça va? 東京はどう?"), _a("Très bien — 東京は晴れ 🙂 naïve")],
    "inline_think": [
        _u("One?"),
        _a("<think>\nhmm\n</think>\n\nFirst."),
        _u("Two?"),
        _a("<think>\nok\n</think>\n\nSecond."),
    ],
}
QWEN_TOOL_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
JSON_TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (template, conversation, options) -> supervised text of each assistant turn
GOLDEN = [
    # Qwen3.6-style: reasoning kept only after the last user query unless preserve_thinking; content trimmed.
    ("qwen3_6_style", "reasoning", {}, ["4." + IM_END, "6." + IM_END, "Polite.\n</think>\n\nYou're welcome." + IM_END]),
    (
        "qwen3_6_style",
        "reasoning",
        {"template_kwargs": {"preserve_thinking": True}},
        [
            "Add.\n</think>\n\n4." + IM_END,
            "Add again.\n</think>\n\n6." + IM_END,
            "Polite.\n</think>\n\nYou're welcome." + IM_END,
        ],
    ),
    (
        "qwen3_6_style",
        "reasoning",
        {"template_kwargs": {"enable_thinking": False, "preserve_thinking": True}},
        [
            "Add.\n</think>\n\n4." + IM_END,
            "Add again.\n</think>\n\n6." + IM_END,
            "Polite.\n</think>\n\nYou're welcome." + IM_END,
        ],
    ),
    ("qwen3_6_style", "reasoning", {"reasoning": "mask"}, ["4." + IM_END, "6." + IM_END, "You're welcome." + IM_END]),
    (
        "qwen3_6_style",
        "reasoning",
        {"reasoning": "drop"},
        ["4." + IM_END, "6." + IM_END, EMPTY_THINK + "You're welcome." + IM_END],
    ),
    ("qwen3_6_style", "empty", {}, [IM_END, EMPTY_THINK + "Hi." + IM_END]),
    # enable_thinking=false: the prompt already holds the empty think block, so only the answer is generated.
    ("qwen3_6_style", "empty", {"template_kwargs": {"enable_thinking": False}}, [IM_END, "Hi." + IM_END]),
    ("qwen3_6_style", "whitespace", {}, [EMPTY_THINK + "Hi there." + IM_END]),
    ("qwen3_6_style", "literal", {}, [EMPTY_THINK + "It ends a turn: <|im_end|> then <|im_start|>." + IM_END]),
    (
        "qwen3_6_style",
        "tools",
        {},
        ["Need the tool.\n</think>\n\n" + QWEN_TOOL_CALL + IM_END, "Report it.\n</think>\n\nSunny, 21 C." + IM_END],
    ),
    ("qwen3_6_style", "tools", {"reasoning": "mask"}, [QWEN_TOOL_CALL + IM_END, "Sunny, 21 C." + IM_END]),
    ("qwen3_6_style", "non_ascii", {}, [EMPTY_THINK + "Très bien — 東京は晴れ 🙂 naïve" + IM_END]),
    ("qwen3_6_style", "inline_think", {}, ["First." + IM_END, "ok\n</think>\n\nSecond." + IM_END]),
    # Qwen3-Thinking-2507 style: the generation prompt opens <think>; content is not trimmed.
    ("think_prompt", "reasoning", {}, ["4." + IM_END, "6." + IM_END, "Polite.\n</think>\n\nYou're welcome." + IM_END]),
    ("think_prompt", "empty", {}, [IM_END, EMPTY_THINK + "Hi." + IM_END]),
    ("think_prompt", "whitespace", {}, [EMPTY_THINK + "  \nHi there.\n  " + IM_END]),
    ("think_prompt", "inline_think", {"reasoning": "mask"}, ["First." + IM_END, "Second." + IM_END]),
    # Qwen3 style with JSON tool calls: a plain generation prompt, so a kept think block is generated (supervised).
    (
        "json_tools",
        "reasoning",
        {},
        ["4." + IM_END, "6." + IM_END, "<think>\nPolite.\n</think>\n\nYou're welcome." + IM_END],
    ),
    (
        "json_tools",
        "tools",
        {},
        [
            "<think>\nNeed the tool.\n</think>\n\n" + JSON_TOOL_CALL + IM_END,
            "<think>\nReport it.\n</think>\n\nSunny, 21 C." + IM_END,
        ],
    ),
    ("json_tools", "tools", {"reasoning": "mask"}, [JSON_TOOL_CALL + IM_END, "Sunny, 21 C." + IM_END]),
    # The header's "\n" and the reply's "  \n" are one token ("\n  \n"): supervised from that token on.
    ("json_tools", "whitespace", {}, ["\n  \nHi there.\n  " + IM_END]),
    ("json_tools", "empty", {}, [IM_END, "Hi." + IM_END]),
    # Llama-3 style: trimmed content, <|eot_id|>; reasoning fields are not rendered by this template.
    ("llama3_style", "reasoning", {}, ["4." + EOT, "6." + EOT, "You're welcome." + EOT]),
    ("llama3_style", "empty", {}, [EOT, "Hi." + EOT]),
    ("llama3_style", "whitespace", {}, ["Hi there." + EOT]),
    ("llama3_style", "literal", {}, ["It ends a turn: <|im_end|> then <|im_start|>." + EOT]),
    ("llama3_style", "non_ascii", {}, ["Très bien — 東京は晴れ 🙂 naïve" + EOT]),
    (
        "llama3_style",
        "inline_think",
        {},
        ["<think>\nhmm\n</think>\n\nFirst." + EOT, "<think>\nok\n</think>\n\nSecond." + EOT],
    ),
    ("llama3_style", "inline_think", {"reasoning": "mask"}, ["First." + EOT, "Second." + EOT]),
    # Gemma style: the assistant is 'model', the system prompt is folded into the first user turn.
    ("gemma_style", "reasoning", {}, ["4." + END_TURN, "6." + END_TURN, "You're welcome." + END_TURN]),
    ("gemma_style", "empty", {}, [END_TURN, "Hi." + END_TURN]),
    ("gemma_style", "whitespace", {}, ["Hi there." + END_TURN]),
    ("gemma_style", "non_ascii", {}, ["Très bien — 東京は晴れ 🙂 naïve" + END_TURN]),
    ("gemma_style", "literal", {}, ["It ends a turn: <|im_end|> then <|im_start|>." + END_TURN]),
]
# The embedded target's template ({% generation %} tags; earlier turns lose an inline think block; no reasoning
# fields) on the embedded tokenizer.
EMBEDDED_GOLDEN = [
    ("reasoning", {}, ["4." + IM_END, "6." + IM_END, "You're welcome." + IM_END]),
    ("empty", {}, [IM_END, "Hi." + IM_END]),
    ("whitespace", {}, ["  \nHi there.\n  " + IM_END]),
    ("literal", {}, ["It ends a turn: <|im_end|> then <|im_start|>." + IM_END]),
    ("non_ascii", {}, ["Très bien — 東京は晴れ 🙂 naïve" + IM_END]),
    ("inline_think", {}, ["First." + IM_END, "<think>\nok\n</think>\n\nSecond." + IM_END]),
    ("inline_think", {"reasoning": "mask"}, ["First." + IM_END, "Second." + IM_END]),
]


def supervised_runs(tok, r) -> list[str]:
    runs, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def _render(tok, conv_name, options):
    options = dict(options)
    conv = normalize_conversation({"messages": CONVS[conv_name]}, reasoning=options.get("reasoning", "supervise"))
    return render(tok, conv, **options)


def _check_tokens(tok, r):
    """The ids are the tokenizer's own tokenization of the rendered text, except that special-token text written
    inside a message is tokenized as text (so a special id occurs exactly where the template put markup)."""
    special_ids = {tid for tid, t in tok.added_tokens_decoder.items() if t.special}
    template_markup = tok.apply_chat_template([_u("x"), _a("y")], tokenize=False)
    n_markup = sum(template_markup.count(t.content) for t in tok.added_tokens_decoder.values() if t.special)
    if "<|im_end|> do?" not in r.text:
        assert r.input_ids == tok(r.text, add_special_tokens=False)["input_ids"]
    assert tok.decode(r.input_ids) == r.text
    assert n_markup > 0 and any(i in special_ids for i in r.input_ids)


@pytest.mark.parametrize(("template", "conv", "options", "expected"), GOLDEN, ids=lambda x: str(x)[:24])
def test_golden_masks(template, conv, options, expected):
    tok = qwen_tokenizer(template)
    r = _render(tok, conv, options)
    assert supervised_runs(tok, r) == expected
    _check_tokens(tok, r)


@pytest.mark.parametrize(("conv", "options", "expected"), EMBEDDED_GOLDEN, ids=lambda x: str(x)[:24])
def test_golden_masks_embedded(tokenizer, conv, options, expected):
    r = _render(tokenizer, conv, options)
    assert supervised_runs(tokenizer, r) == expected


@pytest.mark.parametrize("template", ["qwen3_6_style", "llama3_style", "gemma_style", "json_tools"])
def test_literal_special_text_is_plain_text_and_markup_stays_special(template):
    tok = qwen_tokenizer(template)
    r = _render(tok, "literal", {})
    im_end, im_start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    # The user's and the assistant's "<|im_end|>" / "<|im_start|>" are text: each special id appears only as many
    # times as the template itself writes the token.
    markup = r.text.replace("<|im_end|> do?", "").replace("<|im_end|> then <|im_start|>.", "")
    assert r.input_ids.count(im_end) == markup.count("<|im_end|>")
    assert r.input_ids.count(im_start) == markup.count("<|im_start|>")
    with pytest.raises(RowError, match=r"turn 0 \(user\) content contains the text '<\|im_end\|>'"):
        _render(tok, "literal", {"control_tokens": "quarantine"})


def test_tool_results_are_never_supervised():
    for template in ("qwen3_6_style", "json_tools"):
        tok = qwen_tokenizer(template)
        r = _render(tok, "tools", {})
        assert "sunny, 21 C" in r.text and all("sunny, 21 C" not in s for s in supervised_runs(tok, r))
        assert all("get_weather" not in r.text[s:e] or "<tool_call>" in r.text[s:e] for s, e in r.spans)


def test_turns_the_template_leaves_out_are_not_supervised_and_unlocatable_text_is_quarantined():
    # A template that renders only the last assistant turn of the conversation.
    last_only = (
        "{%- for m in messages -%}{%- if m.role != 'assistant' or loop.last -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    tok = qwen_tokenizer(chat_template=last_only)
    r = _render(tok, "reasoning", {})
    assert supervised_runs(tok, r) == ["You're welcome." + IM_END]
    # A template that rewrites the text (upper-cases it): no exact location exists, so the row is refused.
    tok = qwen_tokenizer(chat_template=last_only.replace("m.content", "m.content | upper"))
    with pytest.raises(RowError, match=r"renders turn 0 \(system\) content differently .* cannot be located exactly"):
        _render(tok, "reasoning", {})
