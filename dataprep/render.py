"""Render a checked conversation with the target's chat template into token ids and an assistant loss mask.

Assistant spans are found by rendering, with no assumption about what the template writes:
1. The conversation is rendered to text T, and once more with every message text (content, reasoning) replaced
   by a unique sentinel. The sentinel rendering gives the template's scaffolding between the texts, so T can be
   parsed exactly: which text of which message lands at which characters of T (or was left out, e.g. the
   reasoning of an earlier turn), and how the template changed it (trimmed it, cut an inline think block).
2. An assistant turn is supervised from the end of its header (the part of the template's generation prompt that
   the rendering contains: `<|im_start|>assistant\\n`, or `...<think>\\n` when the prompt opens a think block)
   through its end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, EOS): reasoning, content and
   tool-call text, exactly as rendered. Tool results and other roles are never supervised.
3. T is tokenized once by the fast tokenizer with character offsets, and a token is supervised when its characters
   overlap a supervised span: a token merged across a span boundary (Qwen's "\\n\\n") is handled, not refused.

Template markup stays special; text written in a message that looks like a special token (a user pasting
`<|im_end|>`) is tokenized as plain text (data.control_tokens=plain_text) or the row is quarantined naming the
token and the message (data.control_tokens=quarantine). `<think>` / `</think>` in an assistant's own text are its
reasoning markup (the inline think convention) and stay special. Where a turn cannot be located exactly, the row is
quarantined with the reason.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.dataprep.normalize import Conversation, RowError

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_THINK_END = "</think>"
# In an assistant's own text these are reasoning markup (the inline `<think>...</think>` convention that templates
# parse), not pasted text: they stay special tokens.
THINK_MARKUP = ("<think>", "</think>")


@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    text: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)  # supervised character spans of `text`


@dataclass(frozen=True)
class RenderOptions:
    mask_turns: str = "all"  # "all" | "last"
    reasoning: str = "supervise"  # "supervise" | "mask" | "drop" (drop is applied in normalize)
    control_tokens: str = "plain_text"  # "plain_text" | "quarantine"
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _TemplateInfo:
    generation_prompt: str
    # Lengths of the generation prompt's prefixes that count as an assistant header, longest first: each ends at a
    # token boundary of the prompt and holds at least its first line.
    header_cuts: tuple[int, ...]
    specials: re.Pattern | None  # literal forms of the tokenizer's special tokens
    end_of_turn: tuple[str, ...]
    reads_reasoning: bool  # the template takes reasoning from a field (so inline think blocks are moved there)

    compiled: Any = None  # the jinja template, rendered directly (apply_chat_template's checks cost ~30%)
    template_vars: dict[str, Any] = field(default_factory=dict)
    generation_tags: bool = False  # the template marks assistant text with {% generation %}


_INFO: dict[tuple[int, str, str], tuple[Any, _TemplateInfo]] = {}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _compile(template: str):
    """transformers' own compiled template and its generation-index renderer, or None where this transformers
    version lacks them (then apply_chat_template is used: the same text, more slowly)."""
    from transformers.utils import chat_template_utils as ctu

    compile_ = getattr(ctu, "_compile_jinja_template", None)
    return (compile_(template) if compile_ else None), getattr(ctu, "_render_with_assistant_indices", None)


def _apply(tok, messages, tools, kwargs, generation_prompt: bool = False, info: _TemplateInfo | None = None) -> str:
    try:
        if info is not None and info.compiled is not None:
            return info.compiled.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=generation_prompt,
                **info.template_vars,
            )
        return tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except Exception as e:  # noqa: BLE001 - jinja raises many types (raise_exception in templates, TypeError, ...)
        raise RowError(
            f"the chat template failed on this conversation: {type(e).__name__}: {e}", "template error"
        ) from None


def _apply_with_generation_spans(tok, messages, tools, info: _TemplateInfo) -> tuple[str, list[tuple[int, int]]]:
    compiled, with_indices = _compile(tok.chat_template)
    try:
        return with_indices(compiled, messages, tools, None, False, **info.template_vars)
    except Exception as e:  # noqa: BLE001
        raise RowError(
            f"the chat template failed on this conversation: {type(e).__name__}: {e}", "template error"
        ) from None


def _info(tok, kwargs: dict[str, Any]) -> _TemplateInfo:
    template = tok.chat_template
    if not isinstance(template, str):
        raise RowError("the tokenizer has no chat_template; use a chat model's tokenizer", "template error")
    key = (id(tok), template, json.dumps(kwargs, sort_keys=True, default=str))
    hit = _INFO.get(key)
    if hit is not None and hit[0] is tok:
        return hit[1]
    probe = [{"role": "user", "content": "Hi."}]
    bare, prompted = _apply(tok, probe, None, kwargs), _apply(tok, probe, None, kwargs, generation_prompt=True)
    if not prompted.startswith(bare) or len(prompted) == len(bare):
        raise RowError(
            "the chat template's generation prompt cannot be found (rendering with add_generation_prompt=True "
            "does not extend the rendering without it), so assistant turns cannot be located",
            "template error",
        )
    gen = prompted[len(bare) :]
    header_min = gen.find("\n") + 1 or len(gen)
    # A header match may only end where a token or a line of the generation prompt ends (never inside `<think>`).
    cuts = {b for _, b in tok(gen, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]}
    cuts = sorted(cuts | {i + 1 for i, c in enumerate(gen) if c == "\n"})  # or where a line of it ends
    specials = sorted(
        {t.content for t in tok.added_tokens_decoder.values() if t.special} | set(tok.all_special_tokens),
        key=len,
        reverse=True,
    )
    eot = tuple(t for t in (*END_OF_TURN, tok.eos_token) if t and t in specials) or tuple(
        t for t in (*END_OF_TURN, tok.eos_token) if t
    )
    compiled, with_indices = _compile(template)
    info = _TemplateInfo(
        compiled=compiled,
        template_vars={**tok.special_tokens_map, **kwargs},
        generation_tags=compiled is not None and with_indices is not None and bool(_GENERATION_TAG.search(template)),
        generation_prompt=gen,
        header_cuts=tuple(m for m in reversed(cuts) if m >= header_min),
        specials=re.compile("|".join(map(re.escape, specials))) if specials else None,
        end_of_turn=eot,
        reads_reasoning="reasoning_content" in template or ".reasoning" in template,
    )
    _INFO[key] = (tok, info)
    return info


def _move_inline_think(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning written inline (`<think>...</think>answer`) goes to reasoning_content for templates that read it
    from there (as Qwen's templates do themselves), so that both are rendered the same way."""
    out = []
    for m in messages:
        c = m.get("content")
        if m["role"] == "assistant" and "reasoning_content" not in m and isinstance(c, str) and _THINK_END in c:
            head, _, tail = c.partition(_THINK_END)
            m = {**m, "reasoning_content": head.split("<think>")[-1].strip("\n"), "content": tail.lstrip("\n")}
        out.append(m)
    return out


def _variants(text: str) -> list[str]:
    """What a template may have made of a text: itself, trimmed, or (inline think blocks) the part after it."""
    out = [text, text.strip(), text.lstrip(), text.rstrip(), text.strip("\n")]
    if _THINK_END in text:
        after = text.split(_THINK_END)[-1]
        out += [after, after.lstrip("\n"), after.strip(), after.lstrip()]
    seen: list[str] = []
    for v in out:
        if v not in seen:
            seen.append(v)
    return seen


@dataclass
class _Field:
    msg: int
    name: str  # "content" | "reasoning_content"
    start: int
    end: int


def _locate_fields(text: str, sentinel_text: str, values: list[tuple[int, str, str]]) -> list[_Field]:
    """Where each sentinel's text landed in `text`, parsing it against the sentinel rendering."""
    parts = _SENTINEL_RE.split(sentinel_text)  # [scaffold, id, scaffold, id, ..., scaffold]
    pos, found = 0, []
    for j in range(0, len(parts) - 1, 2):
        scaffold, idx, after = parts[j], int(parts[j + 1]), parts[j + 2]
        if not text.startswith(scaffold, pos):
            raise _Mismatch(pos)
        pos += len(scaffold)
        msg, name, value = values[idx]
        last = j + 2 == len(parts) - 1
        for v in _variants(value):
            nxt = pos + len(v)
            if text.startswith(v, pos) and text.startswith(after, nxt) and (not last or nxt + len(after) == len(text)):
                break
        else:
            raise _Mismatch(pos, msg, name)
        found.append(_Field(msg, name, pos, pos + len(v)))
        pos += len(v)
    if text[pos:] != parts[-1]:
        raise _Mismatch(pos)
    return found


class _Mismatch(Exception):
    def __init__(self, pos: int, msg: int | None = None, name: str | None = None):
        super().__init__(pos)
        self.pos, self.msg, self.name = pos, msg, name


def _assistant_span(
    text: str, k: int, msg: dict, fields: list[_Field], info: _TemplateInfo, reasoning: str
) -> tuple[int, int, int] | None:
    """(start, end, think_end) of assistant turn k in `text` (None when the rendering does not contain the turn);
    think_end > start when a think block is masked."""
    order = sorted(fields, key=lambda f: f.start)
    own = [f for f in order if f.msg == k]
    before = [f for f in order if f.msg < k]
    after = [f for f in order if f.msg > k]
    lo = before[-1].end if before else 0
    hi = after[0].start if after else len(text)
    head_hi = own[0].start if own else hi
    region, gen = text[lo:head_hi], info.generation_prompt
    start = None
    for m in info.header_cuts:
        p = region.find(gen[:m])
        if p >= 0:
            start = lo + p + m
            break
    if start is None and not own:
        return None  # the template leaves this turn out of the rendering: nothing of it to supervise
    if start is None:
        raise RowError(
            f"turn {k} (assistant): the template's assistant header {gen[: info.header_cuts[-1]]!r} does not appear "
            "before the turn's text, so its tokens cannot be located",
            "turn not located",
        )
    tail_lo = own[-1].end if own else start
    stops = [(p, t) for t in info.end_of_turn if (p := text.find(t, tail_lo, hi)) >= 0]
    if stops:
        p, t = min(stops)
        end = p + len(t)
    elif hi == len(text):
        end = len(text.rstrip())
    else:
        raise RowError(
            f"turn {k} (assistant): no end-of-turn token ({', '.join(info.end_of_turn)}) follows the turn's text",
            "turn not located",
        )
    think_end = start
    if reasoning == "mask":
        content = next((f for f in own if f.name == "content"), None)
        think = next((f for f in own if f.name == "reasoning_content"), None)
        if think is not None:
            if content is not None:
                think_end = content.start
            else:
                q = text.find(_THINK_END, think.end, end)
                think_end = think.end if q < 0 else q + len(_THINK_END)
                while think_end < end and text[think_end] in " \n":
                    think_end += 1
        elif content is not None and _THINK_END in text[content.start : content.end]:  # an inline think block
            think_end = _after_think(text, content.start, content.end)
    return start, end, think_end


def _check_unlocated_text(conv: Conversation, info: _TemplateInfo, k_msgs: list[dict]) -> None:
    """Tool-call names and arguments are rendered by the template without a sentinel: special-token text in them
    could not be told from markup, so such a row is quarantined."""
    if info.specials is None:
        return
    for i, m in enumerate(k_msgs):
        for call in m.get("tool_calls") or []:
            blob = json.dumps(call["function"], ensure_ascii=False)
            hit = info.specials.search(blob)
            if hit:
                raise RowError(
                    f"turn {i} ({m['role']}) tool call {call['function']['name']!r} contains the text of the special "
                    f"token {hit.group()!r}, which cannot be told from template markup; remove it from the arguments",
                    "literal control token",
                )


def _tokenize(tok, text: str, literal: list[tuple[int, int]], info: _TemplateInfo):
    """ids and character offsets of `text`; the `literal` special-token texts (written in messages) become text."""
    if not literal:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), list(enc["offset_mapping"])
    # Split at markup special tokens only; each piece between them is tokenized with special-token text as text.
    # Pieces end at special tokens either way, so with no literal text this equals tokenizing `text` whole.
    literal_starts = {s for s, _ in literal}
    markup = [h for h in info.specials.finditer(text) if h.start() not in literal_starts]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for h in [*markup, None]:
        piece_end = h.start() if h is not None else len(text)
        if piece_end > pos:
            enc = tok(
                text[pos:piece_end], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True
            )
            ids += enc["input_ids"]
            offsets += [(a + pos, b + pos) for a, b in enc["offset_mapping"]]
        if h is not None:
            ids.append(tok.convert_tokens_to_ids(h.group()))
            offsets.append((h.start(), h.end()))
            pos = h.end()
    return ids, offsets


def _has_special_text(messages: list[dict[str, Any]], info: _TemplateInfo) -> bool:
    """Whether any message text holds special-token text (other than an assistant's own think markup)."""
    if info.specials is None:
        return False
    for m in messages:
        for name in ("content", "reasoning_content"):
            v = m.get(name)
            if isinstance(v, str):
                hits = info.specials.findall(v)
                if any(h not in THINK_MARKUP or m["role"] != "assistant" for h in hits):
                    return True
    return False


def _after_think(text: str, start: int, end: int) -> int:
    """Where the answer starts in a span that holds a think block (its end, past following whitespace)."""
    q = text.find(_THINK_END, start, end)
    if q < 0:
        return start
    q += len(_THINK_END)
    while q < end and text[q] in " \n":
        q += 1
    return q


def _mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    ends = [b if b > a else a + 1 for a, b in offsets]
    starts = [a for a, _ in offsets]
    mask = [0] * len(offsets)
    for s, e in spans:
        i0, i1 = bisect.bisect_right(ends, s), bisect.bisect_left(starts, e)
        mask[i0:i1] = [1] * max(0, i1 - i0)
    return mask


def render(tokenizer, conv: Conversation | list[dict[str, Any]], mask_turns: str = "all", **options) -> Rendered:
    """Token ids and a 0/1 loss mask over assistant turns (every turn, or only the last)."""
    opts = RenderOptions(mask_turns=mask_turns, **options)
    if not isinstance(conv, Conversation):
        conv = Conversation(list(conv))
    kwargs = dict(opts.template_kwargs)
    tools = conv.tools if conv.tools is not None else kwargs.pop("tools", None)
    kwargs.pop("tools", None)
    info = _info(tokenizer, kwargs)
    messages = _move_inline_think(conv.messages) if info.reads_reasoning else conv.messages
    _check_unlocated_text(conv, info, messages)
    if info.generation_tags and not _has_special_text(messages, info):
        # The template marks the assistant text itself ({% generation %}): one rendering gives the spans.
        text, spans = _apply_with_generation_spans(tokenizer, messages, tools, info)
        spans = [(s, e) for s, e in spans if e > s]
        if opts.mask_turns == "last":
            spans = spans[-1:]
        if opts.reasoning == "mask":
            spans = [(_after_think(text, s, e), e) for s, e in spans]
        ids, offsets = _tokenize(tokenizer, text, [], info)
        return Rendered(ids, _mask(offsets, spans), text, spans)
    text = _apply(tokenizer, messages, tools, kwargs, info=info)

    values: list[tuple[int, str, str]] = []
    sentinel_msgs = []
    for i, m in enumerate(messages):
        m2 = dict(m)
        for name in ("content", "reasoning_content"):
            v = m.get(name)
            if isinstance(v, str) and v.strip():
                if "\ue000" in v:
                    raise RowError(f"turn {i} {name} contains the private-use character U+E000", "invalid row")
                m2[name] = _SENTINEL.format(len(values))
                values.append((i, name, v))
        sentinel_msgs.append(m2)
    sentinel_text = _apply(tokenizer, sentinel_msgs, tools, kwargs, info=info)
    try:
        fields = _locate_fields(text, sentinel_text, values)
    except _Mismatch as e:
        where = f"turn {e.msg} ({messages[e.msg]['role']}) {e.name}" if e.msg is not None else "the scaffolding"
        raise RowError(
            f"the chat template renders {where} differently when the text is replaced (at character {e.pos} of "
            "the rendering), so the text of each turn cannot be located exactly",
            "turn not located",
        ) from None

    literal: list[tuple[int, int]] = []  # special-token text written inside a message
    if info.specials is not None:
        for f in fields:
            for hit in info.specials.finditer(text, f.start, f.end):
                if hit.group() in THINK_MARKUP and messages[f.msg]["role"] == "assistant":
                    continue  # an inline think block: the model's own reasoning markup, kept special
                if opts.control_tokens == "quarantine":
                    raise RowError(
                        f"turn {f.msg} ({messages[f.msg]['role']}) {f.name} contains the text {hit.group()!r} of a "
                        "special token (data.control_tokens=quarantine; plain_text tokenizes it as text)",
                        "literal control token",
                    )
                literal.append(hit.span())

    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if opts.mask_turns == "last":
        turns = turns[-1:]
    spans = []
    for k in turns:
        found = _assistant_span(text, k, messages[k], fields, info, opts.reasoning)
        if found is not None:
            start, end, think_end = found
            spans.append((max(start, think_end), end))
    ids, offsets = _tokenize(tokenizer, text, literal, info)
    return Rendered(ids, _mask(offsets, spans), text, spans)
