"""The patch series: reading `patches/series`, the patch headers, and strict application.

A patch file is a mail-style header followed by a git diff against the upstream repository layout
(`a/python/sglang/...`):

    From: Name <address>
    Subject: [Diffusion] one line

    ## Motivation
    why upstream needs the change

    ## Modifications
    what it does, written as the body of an upstream PR

    ## Accuracy
    what it does to numerics, and how that was checked

    ## Benchmark
    what it costs

    Adds: python/sglang/...      (one line per new file of this concern, kept under python/)
    ---
    diff --git a/python/sglang/... b/python/sglang/...

Application is strict: every hunk must match the text exactly at the line numbers it states (no
fuzz, no offset). A patch changes files upstream has and files earlier patches add; the files a
patch adds live under python/ in their final form (one source of truth), and the text a patch adds
is that final text with the later patches' hunks on the file undone (`added_file_texts`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import unidiff

from forktools.upstream import REPO_ROOT

PATCHES_DIR = REPO_ROOT / "patches"
NEW_FILES_DIR = REPO_ROOT / "python"
# Patch paths are upstream repository paths; the wheel holds the package without this prefix.
UPSTREAM_PREFIX = "python/"
# The PR description upstream reviewers read (sglang's pull request template).
REQUIRED_SECTIONS = (
    "## Motivation",
    "## Modifications",
    "## Accuracy",
    "## Benchmark",
)


class PatchError(RuntimeError):
    """A patch is malformed or does not apply exactly."""


@dataclasses.dataclass
class Patch:
    path: Path
    author: str
    subject: str
    body: str  # the PR description, without the Adds: trailers
    adds: list[str]  # upstream-layout paths of the new files this concern brings
    diff: str  # the git diff, starting at the first "diff --git" line

    @property
    def name(self) -> str:
        return self.path.name

    def header(self, adds: bool = True) -> str:
        """The mail header; `adds=False` leaves out the fork's `Adds:` trailers (the
        upstream diff shows its new files itself)."""
        trailers = "".join(f"Adds: {p}\n" for p in self.adds) if adds else ""
        return f"From: {self.author}\nSubject: {self.subject}\n\n{self.body.strip()}\n\n{trailers}---\n"


def read_series(patches_dir: Path = PATCHES_DIR) -> list[Patch]:
    series = patches_dir / "series"
    names = [
        line.strip()
        for line in series.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if len(set(names)) != len(names):
        raise PatchError(f"{series}: a patch is listed twice")
    return [parse_patch(patches_dir / name) for name in names]


def parse_patch(path: Path) -> Patch:
    if not path.is_file():
        raise PatchError(f"{path.name}: listed in series but missing")
    text = path.read_text()
    start = text.find("diff --git ")
    if start < 0:
        raise PatchError(f"{path.name}: no diff")
    head = text[:start]
    if not head.endswith("---\n"):
        raise PatchError(
            f"{path.name}: the header must end with a '---' line before the diff"
        )
    head = head[: -len("---\n")]
    header, _, body = head.partition("\n\n")
    fields = dict(line.split(": ", 1) for line in header.splitlines() if ": " in line)
    for key in ("From", "Subject"):
        if not fields.get(key):
            raise PatchError(f"{path.name}: header lacks '{key}:'")
    adds = re.findall(r"^Adds: (\S+)$", body, flags=re.M)
    body = re.sub(r"^Adds: \S+\n?", "", body, flags=re.M).strip() + "\n"
    for section in REQUIRED_SECTIONS:
        if section not in body:
            raise PatchError(f"{path.name}: description lacks a '{section}' section")
    return Patch(path, fields["From"], fields["Subject"], body, adds, text[start:])


def _hunk_label(patch: Patch, file: str, index: int, hunk: unidiff.Hunk) -> str:
    return (
        f"{patch.name}: {file} hunk #{index} "
        f"(@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},{hunk.target_length} @@)"
    )


def _hunk_lines(hunk: unidiff.Hunk) -> tuple[list[str], list[str]]:
    """Source and target lines of a hunk, honouring '\\ No newline at end of file'."""
    source: list[str] = []
    target: list[str] = []
    last: list[list[str]] = []
    for line in hunk:
        if line.line_type == "\\":
            for side in last:
                side[-1] = side[-1].removesuffix("\n")
            continue
        last = []
        if line.line_type in (" ", "-"):
            source.append(line.value)
            last.append(source)
        if line.line_type in (" ", "+"):
            target.append(line.value)
            last.append(target)
    return source, target


def upstream_path(path: str) -> str:
    """Strip git's a/ b/ prefix; the result is an upstream repository path."""
    return path[2:] if path[:2] in ("a/", "b/") else path


def _apply_file_hunks(
    patch: Patch,
    rel: str,
    pfile: unidiff.PatchedFile,
    original: list[str],
    reverse: bool,
) -> list[str]:
    """`original` with the hunks of `pfile` applied exactly (undone when `reverse`)."""
    out: list[str] = []
    pos = 0  # index into `original` of the next line not yet copied
    for index, hunk in enumerate(pfile, start=1):
        source, new = _hunk_lines(hunk)
        start, length = hunk.source_start, hunk.source_length
        if reverse:
            source, new = new, source
            start, length = hunk.target_start, hunk.target_length
        start = start - 1 if length else start
        if start < pos:
            raise PatchError(
                f"{_hunk_label(patch, rel, index, hunk)}: overlaps the previous hunk"
            )
        actual = original[start : start + len(source)]
        if actual != source:
            first = next(
                (i for i, (a, b) in enumerate(zip(actual, source)) if a != b),
                len(actual),
            )
            found = actual[first] if first < len(actual) else "<end of file>"
            raise PatchError(
                f"{_hunk_label(patch, rel, index, hunk)} does not "
                f"{'undo' if reverse else 'apply'} exactly: line "
                f"{start + first + 1} is {found!r}, the patch expects "
                f"{source[first] if first < len(source) else '<end of file>'!r}"
            )
        out += original[pos:start] + new
        pos = start + len(source)
    return out + original[pos:]


def _parse_diff(patch: Patch) -> unidiff.PatchSet:
    try:
        return unidiff.PatchSet(patch.diff)
    except unidiff.UnidiffParseError as e:
        raise PatchError(f"{patch.name}: cannot parse the diff: {e}") from e


def apply_patch(
    patch: Patch, package_root: Path, prefix: str = UPSTREAM_PREFIX
) -> list[Path]:
    """Apply `patch` to the tree whose `prefix` (upstream layout) maps to `package_root`.

    Checks every hunk before writing anything, so a patch that fails leaves the tree unchanged.
    Returns the files it changed.
    """
    results: dict[Path, str] = {}
    for pfile in _parse_diff(patch):
        if pfile.is_added_file or pfile.is_removed_file or pfile.is_rename:
            raise PatchError(
                f"{patch.name}: {pfile.path}: patches only change existing files; "
                f"new files live under python/ and are listed as 'Adds:'"
            )
        rel = upstream_path(pfile.target_file)
        if not rel.startswith(prefix):
            raise PatchError(f"{patch.name}: {rel} is outside {prefix}")
        target = package_root / rel[len(prefix) :]
        if target in results:
            raise PatchError(f"{patch.name}: {rel} appears twice")
        if not target.is_file():
            raise PatchError(
                f"{patch.name}: {rel} is neither upstream's nor added by an earlier patch"
            )
        original = target.read_text().splitlines(keepends=True)
        results[target] = "".join(
            _apply_file_hunks(patch, rel, pfile, original, reverse=False)
        )
    for target, text in results.items():
        target.write_text(text)
    return list(results)


def added_file_texts(patches: list[Patch]) -> list[dict[str, str]]:
    """Per patch of the series, the text of each file it adds, as it adds it: the final text
    under python/ with the hunks of the later patches that change the file undone."""
    new_files(patches)
    texts = []
    for index, patch in enumerate(patches):
        files = {}
        for rel in patch.adds:
            lines = (NEW_FILES_DIR.parent / rel).read_text().splitlines(keepends=True)
            for later in reversed(patches[index + 1 :]):
                for pfile in _parse_diff(later):
                    if upstream_path(pfile.target_file) == rel:
                        lines = _apply_file_hunks(
                            later, rel, pfile, lines, reverse=True
                        )
            files[rel] = "".join(lines)
        texts.append(files)
    return texts


def apply_series(
    patches: list[Patch], package_root: Path, prefix: str = UPSTREAM_PREFIX
) -> list[tuple[Patch, list[Path], list[str]]]:
    """Apply the whole series to an upstream tree: per patch, the files it adds, then its diff.
    The result holds every file under python/ in its final form. Returns per patch the files
    it changed and the ones it added."""
    applied = []
    for patch, added in zip(patches, added_file_texts(patches)):
        write_added_files(added, package_root, prefix)
        applied.append((patch, apply_patch(patch, package_root, prefix), list(added)))
    for rel in new_files(patches):
        if (package_root / rel[len(prefix) :]).read_text() != (
            NEW_FILES_DIR.parent / rel
        ).read_text():
            raise PatchError(f"{rel}: the series does not rebuild python/{rel}")
    return applied


def write_added_files(
    added: dict[str, str], package_root: Path, prefix: str = UPSTREAM_PREFIX
) -> None:
    for rel, text in added.items():
        target = package_root / rel[len(prefix) :]
        if target.exists():
            raise FileExistsError(
                f"{rel} would replace a file upstream has: change it with a patch"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        os.chmod(
            target, 0o644
        )  # whatever the umask: the wheel's bytes stay reproducible


def new_files(patches: list[Patch]) -> dict[str, Patch]:
    """Map each upstream-layout path under python/ to the patch that claims it."""
    owner: dict[str, Patch] = {}
    for patch in patches:
        for rel in patch.adds:
            if rel in owner:
                raise PatchError(
                    f"{rel} is claimed by {owner[rel].name} and {patch.name}"
                )
            owner[rel] = patch
    on_disk = {
        str(p.relative_to(NEW_FILES_DIR.parent))
        for p in NEW_FILES_DIR.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    missing = sorted(set(owner) - on_disk)
    unclaimed = sorted(on_disk - set(owner))
    if missing:
        raise PatchError(
            f"claimed by a patch but missing under python/: {', '.join(missing)}"
        )
    if unclaimed:
        raise PatchError(
            f"under python/ but claimed by no patch ('Adds:'): {', '.join(unclaimed)}"
        )
    return owner
