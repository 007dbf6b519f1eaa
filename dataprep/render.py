"""Render checked messages with the target's chat template into token ids and an assistant loss mask.

Two ways to find assistant tokens, chosen once per tokenizer:
- the template marks assistant content with `{% generation %}` tags: transformers returns the mask;
- otherwise (most real templates, e.g. Qwen3.5's) prefix matching: for assistant turn k, the rendering
  of the turns before it plus the generation prompt must be a token prefix of the full rendering; the
  span runs from there to the turn's end-of-turn token, inclusive. The full rendering is the one
  trained on, so thinking blocks appear (or not) exactly as the template renders them.
The end-of-turn token is supervised (the model must learn to stop); scaffolding is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_pipeline.dataprep.normalize import RowError


@dataclass(frozen=True)
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]


def uses_generation_tags(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "{% generation %}" in template or "{%- generation %}" in template


def _ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(out["input_ids"])


def _end_of_turn_ids(tokenizer) -> set[int]:
    ids = set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", tokenizer.eos_token):
        if tok and tok in tokenizer.get_vocab():
            ids.add(tokenizer.convert_tokens_to_ids(tok))
    return ids


def render(tokenizer, messages: list[dict[str, str]], mask_turns: str = "all") -> Rendered:
    """Token ids and a 0/1 loss mask over assistant tokens (every turn, or only the last)."""
    if tokenizer.chat_template is None:
        raise RowError("the tokenizer has no chat_template; use a chat model's tokenizer")
    if uses_generation_tags(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        spans = _spans(mask)
    else:
        ids = _ids(tokenizer, messages, add_generation_prompt=False)
        eot = _end_of_turn_ids(tokenizer)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = _ids(tokenizer, messages[:k], add_generation_prompt=True)
            if ids[: len(prefix)] != prefix:
                raise RowError(
                    f"chat template renders turn {k}'s history differently inside the full "
                    "conversation, so assistant tokens cannot be located; add {% generation %} "
                    "tags to the template"
                )
            end = next((i for i in range(len(prefix), len(ids)) if ids[i] in eot), len(ids) - 1)
            spans.append((len(prefix), end + 1))
    if mask_turns == "last":
        spans = spans[-1:]
    mask = [0] * len(ids)
    for s, e in spans:
        mask[s:e] = [1] * (e - s)
    return Rendered(ids, mask)


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, v in enumerate(mask + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans
