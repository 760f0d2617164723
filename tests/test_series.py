"""The patch series: strict application, headers, one source of truth, the maintenance workflow."""

from __future__ import annotations

import dataclasses
import filecmp
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from wheel.cli.pack import pack
from wheel.cli.unpack import unpack

from forktools.series import (
    NEW_FILES_DIR,
    PATCHES_DIR,
    REQUIRED_SECTIONS,
    PatchError,
    added_file_texts,
    apply_patch,
    apply_series,
    new_files,
    read_series,
    upstream_path,
)
from forktools.tree import (
    export_tree,
    export_upstream_diffs,
    git,
    open_tree,
    rebase_tree,
)
from tests.conftest import background_output, run


def _first_hunk_target(patch) -> tuple[str, int]:
    """(upstream path, 1-based first source line) of the first hunk of `patch`."""
    import unidiff

    pfile = unidiff.PatchSet(patch.diff)[0]
    return upstream_path(pfile.target_file), pfile[0].source_start


def _changed_files(patch) -> set[str]:
    import unidiff

    return {upstream_path(f.target_file) for f in unidiff.PatchSet(patch.diff)}


def test_every_patch_applies_in_order_exactly(pristine_package, tmp_path):
    root = tmp_path / "pkg"
    shutil.copytree(pristine_package / "sglang", root / "sglang")
    applied = apply_series(read_series(), root)
    assert [p.name for p, _, _ in applied] == [p.name for p in read_series()]
    assert all(changed for _, changed, _ in applied)


TRAIN_PARITY_MODULE = "python/sglang/multimodal_gen/runtime/utils/train_parity_requests.py"


def test_a_patch_builds_on_a_file_an_earlier_patch_adds():
    """train_parity_requests.py arrives with the options patch; the admission patch adds its
    request-input rules later, so the first patch's version lacks them and python/ holds the
    final file."""
    patches = read_series()
    texts = added_file_texts(patches)
    adding = next(i for i, p in enumerate(patches) if TRAIN_PARITY_MODULE in p.adds)
    first = texts[adding][TRAIN_PARITY_MODULE]
    final = (NEW_FILES_DIR.parent / TRAIN_PARITY_MODULE).read_text()
    assert "def _request_input_problems(" not in first
    assert "def _request_input_problems(" in final
    later = [p.name for p in patches[adding + 1 :] if TRAIN_PARITY_MODULE in p.diff]
    assert later, "later patches change the file"


def test_upstream_diffs_carry_no_fork_metadata(tmp_path):
    for path in export_upstream_diffs(tmp_path):
        header = path.read_text().split("\ndiff --git ", 1)[0]
        assert "Adds: " not in header, path.name
        for section in REQUIRED_SECTIONS:
            assert section in header, (path.name, section)


@pytest.fixture(scope="module")
def reviews(request) -> dict[str, str]:
    """`python -m forktools review` (started at collection, tests/conftest.py): each upstream
    diff on the pristine tree with its predecessors (git apply, upstream's formatters on its
    added lines, its own unit tests), its report (`format_review`) by patch name."""
    _, output = background_output(request.config, "review")
    names = {p.name for p in read_series()}
    blocks: dict[str, list[str]] = {}
    lines = None
    for line in output.splitlines():
        name, _, verdict = line.rpartition(": ")
        if name in names and verdict in ("OK", "PROBLEMS"):
            lines = blocks[name] = []
        if lines is not None:
            lines.append(line)
    assert blocks, output  # the review did not run
    return {name: "\n".join(lines) for name, lines in blocks.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", [p.name for p in read_series()])
def test_upstream_diff_is_reviewable_on_its_own(reviews, name):
    assert name in reviews, f"{name} was not reviewed: an earlier diff did not apply"
    review = reviews[name]
    assert review.startswith(f"{name}: OK"), review
    tests = next(line for line in review.splitlines() if line.startswith("  tests ("))
    assert not tests.startswith(
        "  tests (none)"
    ), f"{name} carries no unit test in upstream's layout"
    assert tests.endswith(": passed"), review


def test_series_lists_every_patch_file_once():
    listed = [p.name for p in read_series()]
    on_disk = sorted(p.name for p in PATCHES_DIR.glob("*.patch"))
    assert sorted(listed) == on_disk


def test_every_patch_has_a_pr_style_header():
    for patch in read_series():
        assert patch.subject.startswith("[Diffusion] "), patch.name
        for section in REQUIRED_SECTIONS:
            assert section in patch.body, (patch.name, section)


def test_new_files_are_claimed_once_and_not_upstream(pristine_package):
    owners = new_files(read_series())
    assert owners, "the fork adds files under python/"
    for rel in owners:
        assert not (pristine_package / rel.removeprefix("python/")).exists(), rel


@pytest.mark.parametrize("change", ["offset", "fuzz"])
def test_patch_that_does_not_apply_exactly_names_patch_and_hunk(
    pristine_package, tmp_path, change
):
    patch = read_series()[0]
    rel, line = _first_hunk_target(patch)
    root = tmp_path / "pkg"
    shutil.copytree(pristine_package / "sglang", root / "sglang")
    target = root / rel.removeprefix("python/")
    lines = target.read_text().splitlines(keepends=True)
    if change == "offset":
        lines.insert(0, "# one more line shifts every hunk\n")
    else:
        lines[line - 1] = lines[line - 1].rstrip("\n") + "  # changed context\n"
    target.write_text("".join(lines))
    before = target.read_text()
    with pytest.raises(PatchError) as e:
        apply_patch(patch, root)
    assert (
        patch.name in str(e.value) and "hunk #1" in str(e.value) and rel in str(e.value)
    )
    assert target.read_text() == before  # nothing written


def test_patches_may_not_add_files(tmp_path):
    patch = dataclasses.replace(
        read_series()[0],
        diff="diff --git a/python/sglang/x.py b/python/sglang/x.py\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/python/sglang/x.py\n@@ -0,0 +1 @@\n+x = 1\n",
    )
    with pytest.raises(PatchError, match="new files live under python/"):
        apply_patch(patch, tmp_path)


def _fork_files(fork_wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(fork_wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n.startswith("sglang/")}


def test_upstream_diffs_apply_to_pristine_upstream_and_equal_the_wheel(
    pristine_package, fork_wheel, tmp_path
):
    """Each concern's exported patch applies with `git apply` to upstream's layout
    (python/sglang/...), in order, and the result is the fork wheel's files."""
    repo = tmp_path / "upstream"
    shutil.copytree(pristine_package / "sglang", repo / "python" / "sglang")
    run(["git", "init", "-q"], cwd=repo)
    exported = export_upstream_diffs(tmp_path / "out")
    assert [p.name for p in exported] == [p.name for p in read_series()]
    for path in exported:
        run(["git", "apply", "--check", str(path)], cwd=repo)
        run(["git", "apply", str(path)], cwd=repo)
    fork = _fork_files(fork_wheel)
    tree = {
        str(p.relative_to(repo / "python")): p.read_bytes()
        for p in (repo / "python" / "sglang").rglob("*")
        if p.is_file()
    }
    assert tree.keys() == fork.keys()
    differing = [name for name in tree if tree[name] != fork[name]]
    assert not differing


def test_open_then_export_round_trips(pin, upstream_wheel, tmp_path):
    tree = tmp_path / "tree"
    patches = open_tree(pin, upstream_wheel, tree)
    log = git(tree, "log", "--format=%s", "upstream..HEAD").splitlines()
    assert log[::-1] == [p.subject for p in patches]
    out = tmp_path / "export"
    (out / "patches").mkdir(parents=True)
    export_tree(tree, out / "patches", out / "python")
    for patch in patches:
        assert (out / "patches" / patch.name).read_text() == patch.path.read_text()
    assert (out / "patches" / "series").read_text() == (
        PATCHES_DIR / "series"
    ).read_text()
    cmp = filecmp.dircmp(out / "python", NEW_FILES_DIR, ignore=["__pycache__"])
    assert not (cmp.left_only or cmp.right_only or cmp.diff_files)


def test_edit_in_tree_is_exported_into_its_patch(pin, upstream_wheel, tmp_path):
    tree = tmp_path / "tree"
    patches = open_tree(pin, upstream_wheel, tree)
    rel, _ = _first_hunk_target(patches[-1])
    target = tree / rel
    target.write_text(target.read_text() + "# a maintainer's edit\n")
    git(tree, "commit", "-q", "-a", "--amend", "--no-edit")
    out = tmp_path / "export"
    (out / "patches").mkdir(parents=True)
    export_tree(tree, out / "patches", out / "python")
    assert (
        "+# a maintainer's edit\n" in (out / "patches" / patches[-1].name).read_text()
    )


def _newer_upstream(pin, upstream_wheel: Path, tmp_path: Path, edit) -> Path:
    """A fake next upstream release: the pinned wheel with `edit(package_root)` applied."""
    unpacked = tmp_path / "unpacked"
    unpack(str(upstream_wheel), str(unpacked))
    root = unpacked / f"sglang-{pin.version}"
    edit(root)
    (root / f"sglang-{pin.version}.dist-info").rename(root / "sglang-99.0.0.dist-info")
    dest = tmp_path / "newer"
    dest.mkdir()
    pack(str(root), str(dest), None)
    (wheel,) = dest.iterdir()
    return wheel


def test_rebase_reports_patches_that_no_longer_apply(pin, upstream_wheel, tmp_path):
    patches = read_series()
    shifted, _ = _first_hunk_target(patches[0])
    # the latest patch whose first hunk is in a file no earlier patch changes, so that
    # rewriting a line of its context breaks that patch alone
    targets = [_first_hunk_target(patch) for patch in patches]
    changed = [_changed_files(patch) for patch in patches]
    index = next(
        i
        for i in range(len(patches) - 1, 0, -1)
        if not any(targets[i][0] in files for files in changed[:i])
    )
    broken, line = targets[index]
    assert shifted != broken

    def edit(root: Path) -> None:
        path = root / shifted.removeprefix("python/")
        path.write_text("# new upstream header line\n" + path.read_text())
        path = root / broken.removeprefix("python/")
        lines = path.read_text().splitlines(keepends=True)
        lines[line + 2] = "# upstream rewrote this line\n"
        path.write_text("".join(lines))

    newer = _newer_upstream(pin, upstream_wheel, tmp_path, edit)
    report = dict(rebase_tree(pin, newer, tmp_path / "tree"))
    assert report[patches[0].name].startswith("applies with offset or fuzz")
    assert report[patches[index].name].startswith("DOES NOT APPLY")


def test_check_command_passes(upstream_wheel):
    result = run(
        [
            sys.executable,
            "-m",
            "forktools",
            "check",
            "--upstream-wheel",
            str(upstream_wheel),
        ]
    )
    assert "series OK" in result.stdout
