"""The real-text benchmark's chat builder (bench/realtext/chat.py): conversations from a small fixture directory of
.py files name the function / class / module, its signature and docstring; the answer is its code; held-out
packages give only held-out prompts; two builds are identical."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "realtext"))
import chat  # noqa: E402
import corpus  # noqa: E402

ALPHA_CORE = '''"""Alpha's core: small helpers for tests."""

import math


def area(radius: float, *, squared: bool = False) -> float:
    """Area of a circle.

    Longer explanation that is not quoted.
    """
    r = radius * radius if not squared else radius
    return math.pi * r


def tiny():
    return 1


class Shape(object):
    """A shape with a name."""

    def __init__(self, name):
        self.name = name

    def describe(self, prefix="shape"):
        """Say what it is."""
        text = f"{prefix}: {self.name}"
        return text
'''

ALPHA_UTIL = '''def join_words(words, sep=" "):
    """Join words with a separator."""
    out = sep.join(words)
    return out


async def fetch(url, timeout=3.0):
    """Fetch a URL."""
    await something(url)
    return url
'''

BETA = '''"""Beta: held out."""


def secret_sauce(a, b=2):
    """Mix a and b."""
    c = a + b
    return c * 2
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    root = tmp_path / "site-packages"
    (root / "alpha").mkdir(parents=True)
    (root / "alpha" / "__init__.py").write_text("")
    (root / "alpha" / "core.py").write_text(ALPHA_CORE)
    (root / "alpha" / "util.py").write_text(ALPHA_UTIL)
    (root / "beta").mkdir()
    (root / "beta" / "__init__.py").write_text(BETA)
    (root / "gamma.py").write_text(ALPHA_UTIL.replace("join_words", "glue"))
    (root / "alpha-1.0.dist-info").mkdir()
    (root / "alpha" / "__pycache__").mkdir()
    (root / "alpha" / "__pycache__" / "core.cpython-311.py").write_text("x = 1\n")
    (root / "alpha" / "broken.py").write_text("def oops(:\n")
    return root


def test_items_names_signatures_docstrings_code():
    found = {i.qualname: i for i in chat.items(ALPHA_CORE, "alpha.core")}
    assert set(found) == {"area", "Shape", "Shape.describe"}  # tiny(): 2 lines; dunder methods skipped
    assert found["area"].signature == "def area(radius: float, *, squared: bool=False) -> float"
    assert found["area"].doc == "Area of a circle."
    assert found["area"].code.startswith("def area(") and found["area"].code.endswith("return math.pi * r")
    assert found["Shape"].signature == "class Shape(object)"
    describe = found["Shape.describe"]
    assert describe.code.startswith("def describe(self") and "    return text" in describe.code  # dedented
    assert chat.items("def oops(:\n", "m") == []
    asked = chat.ask(describe)
    assert "method `Shape.describe`" in asked and "def describe(self, prefix='shape')" in asked
    assert "Say what it is." in asked


def test_split_and_sets(site: Path, tmp_path: Path):
    pk = corpus.packages([site])
    assert list(pk) == ["alpha", "beta", "gamma"]
    train, held = corpus.split([site], heldout=("beta", "missing"))
    assert {f.package for f in train} == {"alpha", "gamma"} and {f.package for f in held} == {"beta"}
    assert [f.rel for f in train] == sorted(f.rel for f in train if f.package == "alpha") + ["gamma.py"]
    assert not any("__pycache__" in f.rel for f in train)

    out = tmp_path / "out"
    stats = chat.build_sets([site], out, heldout=("beta", "missing"), seed=3, max_train=None, heldout_per_package=5)
    assert stats["heldout_missing"] == ["missing"]
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (out / "heldout_prompts.jsonl").read_text().splitlines()]
    assert rows and prompts
    assert {r["source"] for r in rows} <= {"alpha", "gamma"} and {p["source"] for p in prompts} == {"beta"}
    text = json.dumps(rows)
    assert "secret_sauce" not in text  # nothing of a held-out package in the training rows
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        for q, a in zip(r["messages"][::2], r["messages"][1::2], strict=True):
            assert a["content"].startswith("```python\n") and a["content"].endswith("\n```")
            if r["kind"] != "module":
                name = q["content"].split("`")[1].split(".")[-1]
                assert f"def {name}(" in a["content"] or f"class {name}" in a["content"]
    for p in prompts:
        assert p["messages"][-1]["role"] == "user" and p["reference"].startswith("```python")
        assert p["id"].startswith("beta:")
    sauce = [p for p in prompts if "secret_sauce" in p["messages"][-1]["content"]]
    assert sauce and "def secret_sauce(a, b=2)" in sauce[0]["messages"][-1]["content"]
    assert "Mix a and b." in sauce[0]["messages"][-1]["content"]
    assert "def secret_sauce(a, b=2):" in sauce[0]["reference"]

    again = tmp_path / "again"
    chat.build_sets([site], again, heldout=("beta", "missing"), seed=3, max_train=None, heldout_per_package=5)
    for name in ("train.jsonl", "heldout_prompts.jsonl"):
        assert (out / name).read_bytes() == (again / name).read_bytes()


def test_multi_turn_and_limits(site: Path):
    train, _ = corpus.split([site], heldout=("beta",))
    rows = chat.build(train, seed=0, per_file=3)
    assert len({r["id"] for r in rows}) == len(rows)
    multi = [r for r in rows if r["kind"] == "multi"]
    assert multi, "some conversations have follow-up turns"
    for r in multi:
        assert len(r["messages"]) >= 4 and r["messages"][2]["content"].startswith("Now write the")
    assert len(chat.build(train, seed=0, per_file=3, limit=2)) == 2
    assert chat.build(train, seed=0, per_file=3, limit=2) == chat.build(train, seed=0, per_file=3, limit=2)
    assert chat.module_name("alpha/__init__.py") == "alpha" and chat.module_name("alpha/core.py") == "alpha.core"
