"""Chat data from the real-text corpus: a user asks for a module, class or function of an installed package (by its
name, signature and docstring), the assistant answers with the code; some conversations have follow-up turns (the
next function of the same module).

    python bench/realtext/chat.py --out runs/realtext/chat [--root SITE_PACKAGES ...] [--max-train 3000]

Writes, in OpenAI `messages` form with a `source` field (the package) and a `kind`:
- train.jsonl: conversations from the training packages (the pipeline's data.source; regenerate rewrites the replies);
- heldout_prompts.jsonl: prompts from the held-out packages (corpus.HELDOUT), each ending with a user turn (the
  pipeline's evaluate.prompts), with the package's own code as `reference`;
- chat_stats.json: counts per split, package and kind.
Plain Python (ast, no third-party imports), deterministic: sorted files, seeds derived from (seed, file path).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import corpus  # type: ignore[no-redef]
else:
    from . import corpus

MIN_LINES, MAX_LINES = 3, 60  # a function or class longer than this is not asked for (it would be cut)
MODULE_LINES = 40  # a module answer is its first lines
MAX_DOC = 400  # characters of a docstring quoted in the user turn


@dataclass(frozen=True)
class Item:
    """A function, method or class of a module, as the user asks for it."""

    module: str  # dotted, e.g. "click.core"
    qualname: str  # "Context.invoke"
    kind: str  # "function" | "class"
    signature: str  # "def invoke(self, callback, /, *args, **kwargs)" | "class Context(object)"
    doc: str  # first paragraph of the docstring, or ""
    code: str


def module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def short_doc(doc: str | None) -> str:
    if not doc:
        return ""
    para = doc.strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in para.splitlines())
    return text if len(text) <= MAX_DOC else text[: MAX_DOC - 3].rstrip() + "..."


def signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {node.name}({', '.join(bases)})" if bases else f"class {node.name}"
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){ret}"


def items(source: str, module: str) -> list[Item]:
    """Top-level functions and classes, and methods of top-level classes, in source order; [] if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[Item] = []
    lines = source.splitlines()  # once: ast.get_source_segment splits the whole file on every call

    def add(node: ast.AST, qual: str) -> None:
        first, last = node.lineno, node.end_lineno or node.lineno
        if not MIN_LINES <= last - first + 1 <= MAX_LINES:
            return
        indent = node.col_offset
        code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[first - 1 : last])
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        out.append(Item(module, qual, kind, signature(node), short_doc(ast.get_docstring(node)), code))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            add(node, node.name)
        elif isinstance(node, ast.ClassDef):
            add(node, node.name)
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and not sub.name.startswith("__"):
                    add(sub, f"{node.name}.{sub.name}")
    return out


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def ask(item: Item, follow_up: bool = False) -> str:
    what = "method" if "." in item.qualname and item.kind == "function" else item.kind
    if follow_up:
        head = f"Now write the {what} `{item.qualname}` from the same module, with this signature:"
    else:
        head = f"Write the {what} `{item.qualname}` of the Python module `{item.module}`, with this signature:"
    text = f"{head}\n\n    {item.signature}"
    if item.doc:
        text += f"\n\nIts docstring says: {item.doc}"
    return text


def ask_module(module: str, package: str, doc: str) -> str:
    text = f"Write the beginning of the module `{module}` of the `{package}` package."
    return text + (f" Its docstring says: {doc}" if doc else "")


def conversations(f: corpus.SourceFile, source: str, seed: int, per_file: int) -> list[dict]:
    """Up to `per_file` conversations about one file: single-turn (a function or class; the module's beginning) and
    multi-turn (a function, then one or two more from the same module)."""
    module = module_name(f.rel)
    found = items(source, module)
    rng = random.Random(f"{seed}:{f.rel}")
    rows: list[dict] = []
    try:
        mod_doc = short_doc(ast.get_docstring(ast.parse(source)))
    except (SyntaxError, ValueError):
        return rows
    order = list(range(len(found)))
    rng.shuffle(order)
    used: set[int] = set()
    for _ in range(per_file):
        free = [i for i in order if i not in used]
        roll = rng.random()
        if roll < 0.15 and mod_doc and not any(r["kind"] == "module" for r in rows):
            head = "\n".join(source.splitlines()[:MODULE_LINES])
            messages = [
                {"role": "user", "content": ask_module(module, f.package, mod_doc)},
                {"role": "assistant", "content": fenced(head)},
            ]
            rows.append(_row(f, module, "module", "module", messages))
            continue
        if not free:
            break
        first = free[0]
        used.add(first)
        messages = [
            {"role": "user", "content": ask(found[first])},
            {"role": "assistant", "content": fenced(found[first].code)},
        ]
        kind = "single"
        turns = 1 + (roll > 0.55) + (roll > 0.85)  # ~45% multi-turn, of those a third with three turns
        for nxt in [i for i in free[1:] if found[i].module == module][: turns - 1]:
            used.add(nxt)
            messages += [
                {"role": "user", "content": ask(found[nxt], follow_up=True)},
                {"role": "assistant", "content": fenced(found[nxt].code)},
            ]
            kind = "multi"
        rows.append(_row(f, module, found[first].qualname, kind, messages))
    return rows


def _row(f: corpus.SourceFile, module: str, name: str, kind: str, messages: list[dict]) -> dict:
    return {"id": f"{f.package}:{module}:{name}:{kind}", "source": f.package, "kind": kind, "messages": messages}


def as_prompt(row: dict) -> dict:
    """A held-out prompt: the conversation up to its last user turn; the package's own answer as `reference`."""
    msgs = row["messages"]
    return {**row, "messages": msgs[:-1], "reference": msgs[-1]["content"]}


def build(
    files: list[corpus.SourceFile],
    seed: int = 0,
    per_file: int = 2,
    limit: int | None = None,
    per_package: int | None = None,
) -> list[dict]:
    """Conversations from `files`, deduplicated by id. Files are read in a seeded shuffled order (of the sorted
    list) until `limit` conversations exist, or `per_package` per package (the held-out set, balanced for
    slicing); so a sample costs only the files it reads, and the same arguments give the same rows."""
    order = list(files)
    random.Random(seed).shuffle(order)
    rows: dict[str, dict] = {}
    per: dict[str, int] = {}
    for f in order:
        if limit is not None and len(rows) >= limit:
            break
        if per_package is not None and per.get(f.package, 0) >= per_package:
            continue
        text = corpus.read_text(f)
        if text is None or not text.strip():
            continue
        for r in conversations(f, text, seed, per_file):
            if r["id"] in rows or (per_package is not None and per.get(f.package, 0) >= per_package):
                continue
            rows[r["id"]] = r
            per[f.package] = per.get(f.package, 0) + 1
    out = list(rows.values())
    return out[:limit] if limit is not None else out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def counts(rows: list[dict]) -> dict:
    by_pkg: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    for r in rows:
        by_pkg[r["source"]] = by_pkg.get(r["source"], 0) + 1
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + 1
    return {"rows": len(rows), "packages": len(by_pkg), "by_kind": by_kind, "by_package": dict(sorted(by_pkg.items()))}


def build_sets(
    roots: list[Path],
    out: Path,
    heldout: tuple[str, ...] = corpus.HELDOUT,
    seed: int = 0,
    max_train: int | None = 3000,
    heldout_per_package: int = 16,
) -> dict:
    train_files, held_files = corpus.split(roots, heldout)
    train = build(train_files, seed, limit=max_train)
    held = [as_prompt(r) for r in build(held_files, seed, per_package=heldout_per_package)]
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout_prompts.jsonl", held)
    missing = sorted(set(heldout) - {f.package for f in held_files})
    stats = {"seed": seed, "heldout": list(heldout), "heldout_missing": missing}
    stats |= {"train": counts(train), "heldout_prompts": counts(held)}
    (out / "chat_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", action="append", type=Path, help="site-packages directory (default: this Python's)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heldout", default=",".join(corpus.HELDOUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train", type=int, default=3000)
    ap.add_argument("--heldout-per-package", type=int, default=16)
    a = ap.parse_args(argv)
    roots = a.root or corpus.site_dirs()
    stats = build_sets(roots, a.out, tuple(a.heldout.split(",")), a.seed, a.max_train, a.heldout_per_package)
    print(json.dumps({k: v for k, v in stats.items() if k != "train"} | {"train_rows": stats["train"]["rows"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
