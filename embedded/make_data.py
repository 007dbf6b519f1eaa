"""Generate the bundled conversations and held-out prompts (deterministic, seeded).

The files under embedded/data/ are committed; this script is how they were made:

    python -m embedded.make_data

The conversations are synthetic but structured (arithmetic, sorting, word games, small "facts"),
multi-turn, with system prompts, and some assistant turns carry a <think> block, so that chat-template
rendering, loss masks and thinking-block handling are exercised the way a real chat dataset does.
Each held-out prompt row also carries `domain` (the generator that made it), a field to slice acceptance by.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
N_CONVERSATIONS = 320
N_HELDOUT = 48

SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a patient math tutor.",
    "You are a friendly assistant who explains each step.",
]
ANIMALS = ["fox", "owl", "otter", "heron", "lynx", "badger", "falcon", "newt", "moth", "crane"]
COLORS = ["red", "blue", "green", "silver", "amber", "violet", "grey", "golden"]
PLACES = ["the forest", "the river", "the mountains", "the desert", "the marsh", "the coast"]
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "window",
    "garden",
    "pencil",
    "planet",
    "summer",
    "bridge",
    "candle",
    "rocket",
    "meadow",
    "violin",
    "harbor",
    "lantern",
]


def _arith(rng: random.Random) -> list[tuple[str, str]]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    think = rng.random() < 0.3
    answer = f"{a} + {b} = {a + b}."
    if think:
        answer = f"<think>\nI add {a} and {b}, which gives {a + b}.\n</think>\n\n{answer}"
    turns = [(f"What is {a} + {b}?", answer)]
    if rng.random() < 0.6:
        c = rng.randint(2, 9)
        turns.append((f"And if you multiply that by {c}?", f"{a + b} * {c} = {(a + b) * c}."))
    if rng.random() < 0.3:
        turns.append(("Is that number even?", "Yes, it is even." if ((a + b) * 2) % 2 == 0 else "No."))
    return turns


def _sorting(rng: random.Random) -> list[tuple[str, str]]:
    nums = [rng.randint(1, 60) for _ in range(rng.randint(3, 7))]
    turns = [
        (
            f"Sort these numbers: {', '.join(map(str, nums))}",
            f"Sorted in ascending order: {', '.join(map(str, sorted(nums)))}.",
        )
    ]
    if rng.random() < 0.5:
        turns.append(
            (
                "Now in descending order, please.",
                f"Sorted in descending order: {', '.join(map(str, sorted(nums, reverse=True)))}.",
            )
        )
    if rng.random() < 0.4:
        turns.append(("What is the largest one?", f"The largest number is {max(nums)}."))
    return turns


def _words(rng: random.Random) -> list[tuple[str, str]]:
    w = rng.choice(WORDS)
    turns = [(f"Spell the word {w} backwards.", f"The word {w} backwards is {w[::-1]}.")]
    if rng.random() < 0.6:
        turns.append((f"How many letters does {w} have?", f"The word {w} has {len(w)} letters."))
    if rng.random() < 0.4:
        turns.append(("Write it in capital letters.", f"In capital letters: {w.upper()}."))
    return turns


def _facts(rng: random.Random) -> list[tuple[str, str]]:
    color, animal, place = rng.choice(COLORS), rng.choice(ANIMALS), rng.choice(PLACES)
    n = rng.randint(2, 12)
    turns = [
        (
            f"Tell me about the {color} {animal}.",
            f"The {color} {animal} lives in {place}. It travels in groups of about {n} "
            f"and is most active at dawn. Its {color} coat helps it hide from larger animals.",
        )
    ]
    if rng.random() < 0.6:
        turns.append((f"Where does the {color} {animal} live?", f"The {color} {animal} lives in {place}."))
    if rng.random() < 0.4:
        turns.append(("Thanks!", "You are welcome. Ask me anything else about animals."))
    return turns


def _lists(rng: random.Random) -> list[tuple[str, str]]:
    k = rng.randint(3, 5)
    items = rng.sample(WORDS, k)
    body = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    turns = [(f"Give me a numbered list of {k} words.", f"Here is a list of {k} words:\n{body}")]
    if rng.random() < 0.5:
        turns.append(
            (
                "Which one comes first in the alphabet?",
                f"<think>\nI compare the words and find the smallest.\n</think>\n\n"
                f"The first in alphabetical order is {min(items)}.",
            )
        )
    return turns


GENERATORS = [_arith, _sorting, _words, _facts, _lists]


def tagged_conversation(rng: random.Random) -> tuple[str, list[dict[str, str]]]:
    """(domain: the generator's name, e.g. 'arith', messages)."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    gen = rng.choice(GENERATORS)
    for user, assistant in gen(rng):
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": assistant})
    return gen.__name__.lstrip("_"), messages


def conversation(rng: random.Random) -> list[dict[str, str]]:
    return tagged_conversation(rng)[1]


def to_sharegpt(messages: list[dict[str, str]]) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


def main() -> None:
    rng = random.Random(20261129)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    convs = [conversation(rng) for _ in range(N_CONVERSATIONS)]
    with open(DATA_DIR / "conversations_messages.jsonl", "w") as f:
        for i, m in enumerate(convs):
            f.write(json.dumps({"id": f"conv-{i:04d}", "messages": m}) + "\n")
    with open(DATA_DIR / "conversations_sharegpt.jsonl", "w") as f:
        for i, m in enumerate(convs):
            f.write(json.dumps({"id": f"conv-{i:04d}", **to_sharegpt(m)}) + "\n")
    held_rng = random.Random(7)  # a different stream: prompts unseen in training
    with open(DATA_DIR / "heldout_prompts.jsonl", "w") as f:
        for i in range(N_HELDOUT):
            domain, msgs = tagged_conversation(held_rng)
            # Keep everything up to (not including) the last assistant turn: a prompt to answer. `domain` is
            # a field to slice acceptance by (evaluate.slice_by).
            f.write(json.dumps({"id": f"heldout-{i:03d}", "domain": domain, "messages": msgs[:-1]}) + "\n")
    print(
        f"wrote {N_CONVERSATIONS} conversations (messages and ShareGPT forms) and {N_HELDOUT} held-out prompts "
        f"to {DATA_DIR} (deterministic: the same files every time)"
    )


if __name__ == "__main__":
    main()
