"""Maintenance of the series: an editable git tree of upstream with the series as commits,
re-export of that tree into patches/ and python/, rebase onto a newer upstream, and the
per-concern diffs for upstream review."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from wheel.cli.unpack import unpack

from forktools.series import (
    NEW_FILES_DIR,
    PATCHES_DIR,
    Patch,
    PatchError,
    added_file_texts,
    apply_patch,
    read_series,
    write_added_files,
)
from forktools.upstream import Pin

BASE_TAG = "upstream"
TREE_PACKAGE_DIR = "python"  # upstream repository layout: python/sglang/...


def git(tree: Path, *args: str, input: str | None = None) -> str:
    result = subprocess.run(
        ["git", "-c", "core.autocrlf=false", *args],
        cwd=tree,
        input=input,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {tree}:\n{result.stderr}")
    return result.stdout


def _author_args(author: str) -> list[str]:
    name, _, email = author.partition(" <")
    return [
        "-c",
        f"user.name={name}",
        "-c",
        f"user.email={email.rstrip('>') or 'unknown'}",
    ]


def _commit(tree: Path, author: str, message: str) -> None:
    git(tree, "add", "-A")
    git(
        tree,
        *_author_args(author),
        "commit",
        "-q",
        "--allow-empty",
        "-F",
        "-",
        input=message,
    )


def _commit_message(patch: Patch) -> str:
    trailers = "".join(f"Adds: {p}\n" for p in patch.adds)
    return f"{patch.subject}\n\n{patch.body.strip()}\n" + (
        f"\n{trailers}" if trailers else ""
    )


def init_upstream_tree(pin: Pin, upstream_wheel: Path, tree: Path) -> None:
    """A git repository holding upstream's package at python/sglang, committed and tagged."""
    if tree.exists() and any(tree.iterdir()):
        raise FileExistsError(f"{tree} exists and is not empty")
    (tree / TREE_PACKAGE_DIR).mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        unpack(str(upstream_wheel), tmp)
        (unpacked,) = Path(tmp).iterdir()
        shutil.move(unpacked / pin.package, tree / TREE_PACKAGE_DIR / pin.package)
    git(tree, "init", "-q", "-b", "main")
    _commit(
        tree,
        "sglang-train-parity <noreply@localhost>",
        f"Upstream {upstream_wheel.name}\n",
    )
    git(tree, "tag", BASE_TAG)


def apply_as_commit(patch: Patch, added: dict[str, str], tree: Path) -> None:
    """Commit `patch` onto the tree: the files it adds (`added`: their text at this patch),
    then its diff."""
    write_added_files(added, tree / TREE_PACKAGE_DIR)
    apply_patch(patch, tree / TREE_PACKAGE_DIR)
    _commit(tree, patch.author, _commit_message(patch))


def open_tree(pin: Pin, upstream_wheel: Path, tree: Path) -> list[Patch]:
    """Editable tree: upstream, then one commit per patch of the series (with its new files)."""
    patches = read_series()
    texts = added_file_texts(
        patches
    )  # every file under python/ is claimed exactly once
    init_upstream_tree(pin, upstream_wheel, tree)
    for patch, added in zip(patches, texts):
        apply_as_commit(patch, added, tree)
    return patches


def _slug(subject: str, limit: int = 60) -> str:
    """File-name form of a subject: tags dropped, lower-case words joined by '-', whole words."""
    subject = re.sub(r"^(\[[^\]]*\]\s*)+", "", subject)
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return slug if len(slug) <= limit else slug[: limit + 1].rsplit("-", 1)[0]


def export_tree(
    tree: Path, patches_dir: Path = PATCHES_DIR, new_files_dir: Path = NEW_FILES_DIR
) -> list[Path]:
    """Write the tree's commits after the upstream tag back as patches/ + python/."""
    commits = git(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    written: list[Path] = []
    added_by: dict[str, str] = {}
    for index, commit in enumerate(commits, start=1):
        message = git(tree, "log", "-1", "--format=%B", commit)
        author = git(tree, "log", "-1", "--format=%an <%ae>", commit).strip()
        subject, _, body = message.partition("\n")
        body = re.sub(r"^Adds: \S+\n?", "", body, flags=re.M).strip() + "\n"
        changed = [
            line.split("\t")
            for line in git(
                tree,
                "diff-tree",
                "--no-commit-id",
                "-r",
                "--no-renames",
                "--name-status",
                commit,
            ).splitlines()
        ]
        adds, modified = [], []
        for status, path in changed:
            if not path.startswith(f"{TREE_PACKAGE_DIR}/"):
                raise PatchError(
                    f"commit {commit[:12]} ({subject}): {path} is outside {TREE_PACKAGE_DIR}/"
                )
            if status == "A":
                adds.append(path)
                added_by[path] = subject
            elif status == "M":  # an upstream file, or one an earlier commit adds
                modified.append(path)
            else:
                raise PatchError(
                    f"commit {commit[:12]} ({subject}): {status} {path}: patches only change files"
                )
        diff = (
            git(
                tree,
                "diff",
                "--no-color",
                "--no-ext-diff",
                "--no-renames",
                "--full-index",
                f"{commit}^",
                commit,
                "--",
                *modified,
            )
            if modified
            else ""
        )
        if not diff:
            raise PatchError(
                f"commit {commit[:12]} ({subject}) changes no existing file: move its files "
                "into a commit that does"
            )
        patch = Patch(
            patches_dir / f"{index:04d}-{_slug(subject)}.patch",
            author,
            subject,
            body,
            sorted(adds),
            diff,
        )
        written.append(patch.path)
        patch.path.write_text(patch.header() + patch.diff)
    for old in patches_dir.glob("*.patch"):
        if old not in written:
            old.unlink()
    (patches_dir / "series").write_text("".join(f"{p.name}\n" for p in written))
    if new_files_dir.exists():
        shutil.rmtree(new_files_dir)
    for path in added_by:
        target = new_files_dir.parent / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(git_show_bytes(tree, f"HEAD:{path}"))
    return written


def git_show_bytes(tree: Path, spec: str) -> bytes:
    return subprocess.run(
        ["git", "show", spec], cwd=tree, capture_output=True, check=True
    ).stdout


def rebase_tree(pin: Pin, new_wheel: Path, tree: Path) -> list[tuple[str, str]]:
    """Apply the series to another upstream release; report each patch's status.

    A patch that applies exactly is committed as is; one that applies only with offsets or fuzz
    (`git apply` accepts it) is committed so that `export` refreshes it; one that does not apply
    is reported and skipped, for the maintainer to redo in the tree.
    """
    patches = read_series()
    texts = added_file_texts(patches)
    init_upstream_tree(pin, new_wheel, tree)
    report = []
    for patch, added in zip(patches, texts):
        try:
            apply_as_commit(patch, added, tree)
            report.append((patch.name, "applies exactly"))
            continue
        except PatchError as exact_error:
            reason = str(exact_error)
        # apply_as_commit wrote the files the patch adds: its diff may build on them
        check = subprocess.run(
            ["git", "apply", "--check", "-"],
            cwd=tree,
            input=patch.diff,
            capture_output=True,
            text=True,
        )
        if check.returncode == 0:
            git(tree, "apply", "-", input=patch.diff)
            _commit(tree, patch.author, _commit_message(patch))
            report.append(
                (
                    patch.name,
                    f"applies with offset or fuzz, refreshed on export ({reason})",
                )
            )
        else:
            report.append(
                (patch.name, f"DOES NOT APPLY: {check.stderr.strip() or reason}")
            )
    return report


def _new_file_diff(rel: str, text: str) -> str:
    lines = text.splitlines(keepends=True)
    out = [
        f"diff --git a/{rel} b/{rel}\n",
        "new file mode 100644\n",
        "--- /dev/null\n",
        f"+++ b/{rel}\n",
    ]
    if lines:
        out.append(f"@@ -0,0 +1{'' if len(lines) == 1 else f',{len(lines)}'} @@\n")
        out += [f"+{line}" for line in lines]
        if not lines[-1].endswith("\n"):
            out.append("\n\\ No newline at end of file\n")
    return "".join(out)


def export_upstream_diffs(out_dir: Path) -> list[Path]:
    """One patch per concern for the upstream repository (`git apply` at the pinned tag),
    holding the patch's changes and the new files it claims."""
    patches = read_series()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for patch, added in zip(patches, added_file_texts(patches)):
        diff = patch.diff + "".join(
            _new_file_diff(rel, text) for rel, text in added.items()
        )
        path = out_dir / patch.name
        path.write_text(patch.header(adds=False) + diff)
        written.append(path)
    return written
