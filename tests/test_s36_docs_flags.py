"""The guides' commands and option tables agree with the roles' command lines.

Every ``python -m petals_chain.ROLE ...`` command quoted in the READMEs and docs/architecture.md parses with that
role's parser; every flag in the server's and orchestrator's option tables exists, with the choices the table
lists; every flag of those two roles is named in its guide; every script, test and example the guides point to
exists. A doc that names a flag the code lacks (or the reverse) fails here, not in a new user's terminal.
"""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "server/README.md", "orchestrator/README.md", "client/README.md", "docs/architecture.md"]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
PEER_ID = "QmbTQZh74tPnSEn8TkhPni63W8LG3qYfzh4KSDgJWYp56y"  # a well-formed one for the docs' "Qm..."
FILE_REF = re.compile(r"(?<![\w/.])((?:scripts|tests|client|server|petals_chain)/[\w/]+\.(?:py|sh))")
SHELL_LINE = re.compile(r"\s*(?:[A-Z_]+=\S*\s+)*(?:ExecStart=)?\S*python3? -m ")
COMMAND = re.compile(r"python3? -m petals_chain\.(server|orchestrator|dashboard|sim|demo|fetch)(?![\w|.])")


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from petals_chain.dashboard.__main__ import build_parser as dashboard
    from petals_chain.orchestrator.__main__ import build_parser as orchestrator
    from petals_chain.server.__main__ import build_parser as server
    from petals_chain.sim.__main__ import build_parser as sim

    return {"server": server, "orchestrator": orchestrator, "dashboard": dashboard, "sim": sim}


def _help_flags(role: str) -> set[str]:
    """The flags ``python -m petals_chain.ROLE --help`` lists (demo and fetch build their parser in main)."""
    out = subprocess.run([sys.executable, "-m", f"petals_chain.{role}", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return set(FLAG.findall(out))


def _commands(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, role, arguments) of every role command in ``text``: in code blocks (continuation lines joined, comments
    dropped) and in inline code spans."""
    found = []
    lines = text.splitlines()
    in_block, i = False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_block = not in_block
            i += 1
            continue
        start = i
        if in_block:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            # a command line (not a diagram that names a command): optional env assignments or systemd's ExecStart=
            spans = [line.split(" #")[0]] if SHELL_LINE.match(line) else []
        else:
            spans = re.findall(r"`([^`]*)`", line)
        for span in spans:
            for m in COMMAND.finditer(span):
                rest = re.split(r"&&|;|\|\|", span[m.end():])[0]
                try:
                    args = shlex.split(rest)
                except ValueError:
                    args = rest.split()
                found.append((start + 1, m.group(1), _placeholders(args)))
        i += 1
    return found


def _placeholders(args: list[str]) -> list[str]:
    """``args`` with the docs' placeholders made concrete: ``...`` after a flag is a value (elsewhere: "and the
    rest", dropped), ``Qm...`` a peer id, ``{a,b,...}`` its first alternative."""
    out = []
    for a in args:
        if a == "...":
            if out and out[-1].startswith("--"):
                out.append("X")
            continue
        a = re.sub(r"Qm\w*\.\.\.", PEER_ID, a)
        out.append(a[1:].split(",")[0] if a.startswith("{") else a)
    return out


def _lenient(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` with no argument required: a doc's fragment may leave out what is not its point."""
    parser = copy.deepcopy(parser)
    for action in parser._actions:
        action.required = False
        if not action.option_strings and action.nargs is None:
            action.nargs = "?"
    return parser


def test_every_quoted_command_parses():
    parsers = {role: _lenient(build()) for role, build in _parsers().items()}
    help_flags: dict[str, set[str]] = {}
    bad = []
    for doc in DOCS:
        for line, role, args in _commands((ROOT / doc).read_text()):
            where = f"{doc}:{line}: python -m petals_chain.{role} {' '.join(args)}"
            if "--help" in args or "-h" in args:
                continue
            if role in parsers:
                try:
                    parsers[role].parse_args(args)
                except SystemExit:
                    bad.append(where)
            else:
                known = help_flags.setdefault(role, _help_flags(role))
                bad += [f"{where}  ({flag} unknown)" for flag in FLAG.findall(" ".join(args)) if flag not in known]
    assert not bad, "commands in the docs that the role's command line refuses:\n" + "\n".join(bad)


def _table_rows(text: str) -> list[tuple[int, str]]:
    """(line, first cell) of every option-table row (cells split at ``|`` that is not escaped)."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("| `--"):
            rows.append((n, re.split(r"(?<!\\)\|", line)[1]))
    return rows


@pytest.mark.parametrize("role", ["server", "orchestrator"])
def test_option_table_matches_the_parser(role):
    doc = f"{role}/README.md"
    text = (ROOT / doc).read_text()
    actions = {opt: a for a in _parsers()[role]()._actions for opt in a.option_strings}
    bad = []
    for line, cell in _table_rows(text):
        for code in re.findall(r"`([^`]*)`", cell):
            flags = FLAG.findall(code)
            for flag in flags:
                if flag not in actions:
                    bad.append(f"{doc}:{line}: {flag} is not a flag of {role}")
            m = re.fullmatch(r"(--[a-z0-9-]+) ([\w.:-]+(?:\\\|[\w.:-]+)+)", code.strip())
            if m and m.group(1) in actions and actions[m.group(1)].choices is not None:
                listed = set(m.group(2).split("\\|"))
                choices = {str(c) for c in actions[m.group(1)].choices}
                if listed != choices:
                    bad.append(f"{doc}:{line}: {m.group(1)} lists {sorted(listed)}, the parser takes "
                               f"{sorted(choices)}")
    named = set(FLAG.findall(text))
    bad += [f"{doc}: {opt} (a flag of {role}) is not named" for opt in sorted(actions)
            if opt.startswith("--") and opt != "--help" and opt not in named]
    assert not bad, "\n".join(bad)


def test_referenced_files_exist():
    missing = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for ref in set(FILE_REF.findall(text)):
            if not (ROOT / ref).is_file():
                missing.append(f"{doc}: {ref}")
        for ref, test in set(re.findall(r"(tests/\w+\.py)::(\w+)", text)):
            if (ROOT / ref).is_file() and not re.search(rf"def {test}\b", (ROOT / ref).read_text()):
                missing.append(f"{doc}: {ref}::{test}")
    assert not missing, "files or tests the docs name that do not exist:\n" + "\n".join(missing)


def test_fresh_machine_commands_exist():
    """README's two commands: ``bash scripts/setup.sh && python3 -m petals_chain.demo`` and
    ``bash scripts/setup.sh dev && python3 -m pytest -q``."""
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && python3 -m petals_chain.demo" in readme
    assert "bash scripts/setup.sh dev && python3 -m pytest -q" in readme
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert '"${1:-}" = "dev"' in setup and "petals_chain.fetch" in setup
    assert {"--tiny", "--keep-running"} <= _help_flags("demo")
