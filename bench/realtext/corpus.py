"""The real-text corpus: Python source and docstrings of the installed packages (a site-packages directory).

A *package* is a top-level entry of site-packages: a directory holding .py files (its name is the import name, e.g.
`numpy`) or a single module file (`six.py` -> `six`). Whole packages are held out for evaluation (HELDOUT: a fixed,
named list), so held-out loss and held-out prompts measure text the target never saw, written by other authors.

Deterministic: packages and files are listed in sorted order; nothing depends on the file system's order. Files over
MAX_FILE_BYTES (generated tables: unicode data, lexer maps) and undecodable files are skipped and counted.
"""

from __future__ import annotations

import site
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Held out for evaluation (present on the GPU machine's image and in this repo's venv): human-written, documented,
# mid-sized libraries of different kinds (CLI, templating, text formats, HTTP, terminal UI, progress bars).
HELDOUT = ("click", "jinja2", "markdown", "requests", "rich", "tqdm")
MAX_FILE_BYTES = 512 * 1024
SKIP_DIRS = {"__pycache__", ".git"}


@dataclass(frozen=True)
class SourceFile:
    package: str
    path: Path  # absolute
    rel: str  # path below site-packages, e.g. "click/core.py"


def site_dirs() -> list[Path]:
    """This interpreter's site-packages directories (the GPU machine's: one under /opt/torch/.venv)."""
    return [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]


def packages(roots: list[Path]) -> dict[str, Path]:
    """Package name -> its path (a directory or a .py file), sorted by name; the first root wins a duplicate."""
    found: dict[str, Path] = {}
    for root in roots:
        for entry in sorted(root.iterdir(), key=lambda p: p.name):
            name = entry.name
            if name.startswith((".", "_")) or name.endswith((".dist-info", ".egg-info", ".libs", ".data")):
                continue
            if entry.is_dir() and name not in SKIP_DIRS and name.isidentifier():
                found.setdefault(name, entry)
            elif entry.is_file() and name.endswith(".py") and name[:-3].isidentifier():
                found.setdefault(name[:-3], entry)
    return dict(sorted(found.items()))


def package_files(name: str, path: Path, root: Path | None = None) -> list[SourceFile]:
    """The .py files of one package, sorted by relative path."""
    root = root or path.parent
    if path.is_file():
        return [SourceFile(name, path, path.relative_to(root).as_posix())]
    out = []
    for p in sorted(path.rglob("*.py")):
        if any(part in SKIP_DIRS for part in p.relative_to(path).parts) or not p.is_file():
            continue
        out.append(SourceFile(name, p, p.relative_to(root).as_posix()))
    return out


def split(roots: list[Path], heldout: tuple[str, ...] = HELDOUT) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files), each sorted by (package, relative path)."""
    train: list[SourceFile] = []
    held: list[SourceFile] = []
    for name, path in packages(roots).items():
        files = package_files(name, path)
        (held if name in heldout else train).extend(files)
    return train, held


def read_text(f: SourceFile) -> str | None:
    """The file's text, or None when it is too large or not UTF-8 (counted by callers as skipped)."""
    try:
        if f.path.stat().st_size > MAX_FILE_BYTES:
            return None
        return f.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def document(f: SourceFile, text: str) -> str:
    """One training document: the file's path as a comment line, then its source (the model learns path -> code)."""
    return f"# {f.rel}\n{text}"


def iter_documents(files: list[SourceFile]) -> Iterator[tuple[SourceFile, str]]:
    for f in files:
        text = read_text(f)
        if text is not None and text.strip():
            yield f, document(f, text)
