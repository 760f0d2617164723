"""Upstream's formatters on the lines the series adds.

Upstream sglang runs isort 5.13.2 (its .isort.cfg: profile black, sglang first-party), black
24.10.0 and codespell 2.4.1 (with its ignore lists) in pre-commit. Not every upstream file is clean
under them, so a patch is held to what it adds: an added line that isort or black would rewrite, or
that codespell flags, is a problem; upstream's own lines are left as they are.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

# upstream's .pre-commit-config.yaml (-L) and python/pyproject.toml [tool.codespell]
CODESPELL_IGNORE = "cann,thi,makro,wil,rouge,PRIS,ans,als,hel,boostrap,childs,te,vas,hsa,ment"  # codespell:ignore


def formatted(text: str) -> str:
    """`text` as upstream's pre-commit leaves it: isort, then black."""
    import black
    import isort

    text = isort.code(
        text, config=isort.Config(profile="black", known_first_party=["sglang"])
    )
    return black.format_str(text, mode=black.Mode())


def added_lines(before: str, after: str) -> set[int]:
    """0-based indices of the lines of `after` that are not in `before` (as a diff sees it)."""
    matcher = difflib.SequenceMatcher(
        None, before.splitlines(), after.splitlines(), autojunk=False
    )
    return {
        j
        for tag, _, _, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
        for j in range(j1, j2)
    }


def _rewritten_lines(text: str) -> set[int]:
    """0-based indices of the lines of `text` the formatters change, or next to which they
    insert lines."""
    lines = text.splitlines()
    matcher = difflib.SequenceMatcher(
        None, lines, formatted(text).splitlines(), autojunk=False
    )
    rewritten: set[int] = set()
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag == "equal":
            continue
        # an insertion sits between lines i1 - 1 and i1
        rewritten.update(range(i1, i2) if i2 > i1 else (i1 - 1, i1))
    return rewritten


def _misspelled(lines: list[str]) -> list[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "codespell_lib",
                "-L",
                CODESPELL_IGNORE,
                f.name,
            ],
            capture_output=True,
            text=True,
        )
    finally:
        Path(f.name).unlink()
    return [
        line.split(":", 1)[1].strip()
        for line in result.stdout.splitlines()
        if line.startswith(f.name)
    ]


def style_problems(name: str, before: str | None, after: str) -> list[str]:
    """Upstream formatter findings on the lines `after` adds to `before` (None: a new file)."""
    if not name.endswith(".py"):
        return []
    lines = after.splitlines()
    added = set(range(len(lines))) if before is None else added_lines(before, after)
    problems = [
        f"{name}:{i + 1}: isort/black would rewrite: {lines[i].strip()!r}"
        for i in sorted(added & _rewritten_lines(after))
        if i < len(lines)
    ]
    problems += [
        f"{name}: codespell: {finding}"
        for finding in _misspelled([lines[i] for i in sorted(added)])
    ]
    return problems
