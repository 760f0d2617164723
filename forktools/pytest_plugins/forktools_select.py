"""pytest plugin (`-p forktools_select`, this folder on PYTHONPATH): run only the tests named in
the file $FORKTOOLS_SELECT, one a line: a node id, or a test file's path for all of its tests.
A name the tree lacks selects nothing, where pytest, given it as an argument, would stop the
whole run ("not found"): upstream_suite reruns the fork's failures on a pristine tree that may
lack some of them."""

import os


def pytest_collection_modifyitems(config, items):
    with open(os.environ["FORKTOOLS_SELECT"]) as f:
        wanted = set(f.read().splitlines())
    chosen = [
        item.nodeid in wanted or item.nodeid.split("::")[0] in wanted for item in items
    ]
    config.hook.pytest_deselected(items=[i for i, c in zip(items, chosen) if not c])
    items[:] = [i for i, c in zip(items, chosen) if c]
