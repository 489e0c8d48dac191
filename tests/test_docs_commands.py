"""Every `python -m inference_engine` / `inference-engine` command in the README and docs/ parses as typed.

Commands in ```bash blocks are parsed whole by the launcher's own parser; commands quoted inline
(`serve --persist-sessions DIR`) must name a real subcommand and only flags it has.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from inference_engine.__main__ import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENDS = {"&", "&&", "|", ">", "2>", ";", "||"}
INLINE = re.compile(r"`((?:\S*python3? )?-m inference_engine [^`]+|\S*inference-engine [^`]+)`")


def _argv(words: list[str]) -> list[str] | None:
    """The launcher's arguments in a shell command's words (None when it runs something else)."""
    for i, word in enumerate(words):
        if word.endswith("inference-engine") or (word == "inference_engine" and i and words[i - 1] == "-m"):
            argv = []
            for w in words[i + 1:]:
                if w in ENDS:
                    break
                argv.append(w)
            return argv
    return None


def block_commands(text: str) -> list[list[str]]:
    """The launcher commands of every ```bash block, continuation lines joined."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quoted string goes on over the next line (a JSON body)
                pending += "\n"
                continue
            pending = ""
            argv = _argv(words)
            if argv is not None:
                found.append(argv)
        assert not pending, f"unclosed quote in a bash block: {pending[:80]}"
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_pages_have_commands_to_check():
    commands = [c for page in PAGES for c in block_commands(page.read_text())]
    assert len(commands) >= 10 and {c[0] for c in commands} >= {"serve", "chat", "generate", "shard-worker"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_parses(page):
    parser, has_server = build_parser()
    assert has_server
    for argv in block_commands(page.read_text()):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{page.name}: `{' '.join(argv)}` does not parse (exit {exc.code}): {err.getvalue()}")
    commands = _subparsers(parser)
    for quoted in INLINE.findall(page.read_text()):
        argv = _argv(shlex.split(quoted.replace("|", " ")))
        if not argv or argv[0].startswith("-"):
            continue
        assert argv[0] in commands, f"{page.name}: `{quoted}` names no command"
        flags = {s for a in commands[argv[0]]._actions for s in a.option_strings}
        unknown = [w.split("=")[0] for w in argv[1:] if w.startswith("--") and w.split("=")[0] not in flags]
        assert not unknown, f"{page.name}: `{quoted}`: {argv[0]} has no {', '.join(unknown)}"


def test_a_wrong_flag_is_caught():
    parser, _ = build_parser()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(block_commands("```bash\npython -m inference_engine serve --max-sesions 3\n```")[0])
    assert block_commands("```bash\nX=1 .venv/bin/inference-engine chat \\\n  --tls-ca ca.pem &  # bg\n```") == [
        ["chat", "--tls-ca", "ca.pem"]]
