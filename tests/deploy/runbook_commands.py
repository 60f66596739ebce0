"""Commands and PromQL in runbooks/*.md, extracted from their fenced code blocks.

```bash blocks hold shell commands (one per line, `\\` continues a line, `#` starts a comment);
```promql blocks hold one PromQL expression each, blank lines between them.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def runbook_files() -> list[Path]:
    return sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")


def blocks(language: str) -> list[tuple[str, str]]:
    return [
        (path.name, body)
        for path in runbook_files()
        for lang, body in FENCE.findall(path.read_text())
        if lang == language
    ]


def promql_snippets() -> list[tuple[str, str]]:
    return [
        (where, expr.strip()) for where, body in blocks("promql") for expr in re.split(r"\n\s*\n", body) if expr.strip()
    ]


def shell_commands() -> list[tuple[str, list[str]]]:
    """(runbook, argv) of every simple command, pipelines and `&&` chains split apart."""
    commands = []
    for where, body in blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for part in re.split(r"\s*(?:\|\||&&|\||;)\s*", line):
                argv = shlex.split(part, comments=True)
                if argv:
                    commands.append((where, argv))
    return commands


def program_argv(argv: list[str], program: str) -> list[str] | None:
    """The arguments of `program` in argv, also behind `kubectl exec … --`, `ray exec …` or a venv path."""
    for index, word in enumerate(argv):
        if word == program or word.endswith(f"/bin/{program}"):
            if index == 0 or argv[index - 1] == "--":
                return argv[index + 1 :]
    return None
