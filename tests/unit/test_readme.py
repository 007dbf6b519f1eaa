"""The commands the README and docs/ show are real: every `dflash-pipeline ...` line parses with the CLI's own parser
and its `--set` keys and values load as a config, every `make X` is a Makefile target, and every
`prefect deployment run 'dflash-pipeline/NAME' -p overrides=JSON` names a deployment of deployments/prefect.yaml with
keys the config knows. (The e2e layer runs the commands themselves: make run's config, serve, deployment runs,
verify; this keeps the text from drifting away from them.)"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.cli import build_parser
from dflash_pipeline.config import load_config, parse_override

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _shell_lines(path: Path) -> list[str]:
    """The commands of the file's ```bash blocks, continuation lines joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _commands(word: str) -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for line in _shell_lines(path):
            argv = shlex.split(line)
            for i, token in enumerate(argv):
                if token.endswith(word):
                    found.append((f"{path.name}: {line}", argv[i + 1 :]))
                    break
    return found


CLI = _commands("dflash-pipeline")


def test_the_docs_show_the_main_commands():
    verbs = {argv[0] for _, argv in CLI if argv}
    assert {"run", "plan", "verify", "serve", "show-config"} <= verbs, verbs


@pytest.mark.parametrize(("where", "argv"), CLI, ids=[w for w, _ in CLI])
def test_a_documented_cli_command_parses_and_its_settings_load(where, argv):
    args = build_parser().parse_args([a for a in argv if a not in ("&",)])
    overrides = dict(parse_override(s) for s in getattr(args, "set", []) or [])
    if args.command in ("run", "plan") and not args.config:  # a user's own --config file is not in the repo
        load_config(None, overrides)


def test_every_make_target_shown_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z0-9-]+):", makefile, flags=re.M))
    shown = {m for path in DOCS for line in _shell_lines(path) for m in re.findall(r"^make ([a-z0-9-]+)", line)}
    shown |= {m for path in DOCS for m in re.findall(r"`make ([a-z0-9-]+)`", path.read_text())}
    assert shown and shown <= targets, shown - targets


def test_every_deployment_run_shown_names_a_deployment_and_valid_overrides():
    deployments = {d["name"] for d in yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())["deployments"]}
    runs = _commands("prefect")
    assert runs
    for where, argv in runs:
        if argv[:2] != ["deployment", "run"]:
            continue
        flow, name = argv[2].split("/")
        assert flow == "dflash-pipeline" and name in deployments, where
        for i, a in enumerate(argv):
            if a == "-p" and argv[i + 1].startswith("overrides="):
                load_config(None, json.loads(argv[i + 1].split("=", 1)[1]))


# A message or docstring that sends the reader to a section: `(README: 'Section')`, `docs/STORE.md, "Section"`.
SECTION_REF = re.compile(r"\b(README|docs/[A-Z]+\.md)[:,]? ['\"]([^'\"]+)['\"]")
CODE = ["core", "dataprep", "deployments", "drafter", "embedded", "extraction", "flows", "storage", "tasks"]


def _strings(tree: ast.AST):
    """Every string of a module as Python joins it (adjacent literals, an f-string's parts with {} for fields)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def test_every_section_a_message_points_to_is_in_that_document():
    # two errors sent readers to README sections that live in docs/OPERATIONS.md and docs/DRAFTER.md
    refs = {
        (str(f.relative_to(ROOT)), "README.md" if doc == "README" else doc, section)
        for folder in CODE
        for f in sorted((ROOT / folder).rglob("*.py"))
        for s in _strings(ast.parse(f.read_text()))
        for doc, section in SECTION_REF.findall(s)
    }
    assert len(refs) >= 10, refs
    for where, doc, section in sorted(refs):
        text = (ROOT / doc).read_text().splitlines()
        leads = [line.lstrip("#*").strip() for line in text if line.startswith(("#", "**"))]  # headings, bold leads
        assert any(lead.startswith(section) for lead in leads), f"{where}: {doc} has no section {section!r}"
