"""pytest runs forked from one process that has imported the heavy third-party packages once.

`forktools review` runs each patch's unit tests in a tree of its own, a pytest process each: ~20
processes that each spent ~9 of their ~15 CPU-seconds importing torch, transformers, diffusers
and the like before sglang. This script, run as `python pytest_fork_server.py [MODULE...]` (its folder,
not the repository, first on its path), imports those (PRELOAD, or the modules named; never
sglang, which each tree brings itself), then reads one JSON request a line from stdin, forks a child per request that runs
`pytest.main` as `python -m pytest` would (the working directory, environment, sys.path and
sys.argv of that process; stdout and stderr to a file; stdin /dev/null), and answers a JSON line
with the child's exit status. `forktools.upstream_suite.forked_pytest` is the client.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

# What every review run imports before or beside sglang; nothing that reads an environment
# variable sglang sets on import (sglang.srt.environ points triton's and inductor's caches
# before they are first used: neither is preloaded here, and inductor's cache_dir is not called).
PRELOAD = (
    "numpy",
    "torch",
    "transformers",
    "diffusers",
    "peft",
    "PIL.Image",
    "pytest",
)


def _child(request: dict, base_path: list[str]) -> None:
    """Run the request's pytest in this (forked) process and exit with its status."""
    status = 70
    try:
        env, root = request["env"], request["cwd"]
        os.chdir(root)
        os.environ.clear()
        os.environ.update(env)
        # `python -m pytest` in `root`: the working directory, then PYTHONPATH, then the rest
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [root, *pythonpath, *base_path]
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        import pytest

        sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py")]
        sys.argv += request["args"]
        status = int(pytest.main(request["args"]))
    except (
        BaseException
    ):  # noqa: B036 - the child must never return into the server loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve(preload: list[str]) -> None:
    base_path = sys.path[1:]  # without this script's folder
    for name in preload:
        importlib.import_module(name)
    while line := sys.stdin.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base_path)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:] or list(PRELOAD))  # the modules to preload
