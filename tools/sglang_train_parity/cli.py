# SPDX-License-Identifier: Apache-2.0
"""``sglang-train-parity``: the fork's command for checking ``--numerics train_parity``.

    sglang-train-parity demo   an RL rollout loop through the real server, recomputed as the
                               trainer does (sglang_train_parity.rollout_demo)
    sglang-train-parity check  sglang's DiT against diffusers + PEFT, module by module
                               (sglang_train_parity.check)
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "sglang_train_parity.rollout_demo",
    "check": "sglang_train_parity.check",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    import importlib

    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
