"""The fork's tool modules (tools/sglang_train_parity) loaded straight from this checkout, for
scripts that run against pristine upstream sglang or without importing sglang at all (the GPU
proof of the autocast emulation)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools" / "sglang_train_parity"


def load_tool(name: str) -> ModuleType:
    key = f"_train_parity_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
