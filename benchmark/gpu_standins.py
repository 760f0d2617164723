"""Import-time stand-ins for `sgl_kernel` on a GPU machine that cannot install it.

The H200 image (Python 3.12, torch 2.11) does not have it and cannot fetch it (370 MB, no network).
`sgl_kernel` (sglang-kernel) is imported at module level by sglang on CUDA, submodules included
(`sgl_kernel.flash_attn`, `sgl_kernel.scalar_type`, ...), and some attributes are read at import time
(`scalar_types.uint4b8`). IPython, which `sglang/utils.py` imports, travels as a wheel
(benchmark/prepare_wheels.sh): matplotlib probes whatever IPython it finds.

`install()` appends a meta-path finder (last, so a real installed package always wins) that creates
those modules on demand. Every attribute of a stand-in module is a `StandIn`: attribute access on it
gives further stand-ins (so import-time reads work), and *calling* one raises
`RuntimeError("stand-in <name> called ...")` after counting the call. A parity result can therefore
never come from a fake kernel: a call fails loudly, and `calls()` says which stand-ins were called.
Nothing else is registered: no other module, no torch op, no fake CUDA.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.machinery
import sys
import types

ROOTS = ("sgl_kernel",)

_calls: collections.Counter = collections.Counter()
_modules_created: list[str] = []
# Called with the stand-in's name on every call, before it raises (benchmark/server_harness.py
# records them, so that a call swallowed by some caller's `except` is still on record).
_call_listeners: list = []


class StandInCalled(RuntimeError):
    """A stand-in for a kernel that is not installed here was called."""


class StandIn:
    """Any attribute of a stand-in module: readable, never callable."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def __getattr__(self, name: str) -> "StandIn":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        _calls[self._qualname] += 1
        for listener in _call_listeners:
            listener(self._qualname)
        raise StandInCalled(
            f"stand-in {self._qualname} called: the real package is not installed on this "
            "machine (benchmark/gpu_standins.py); no result may come from it"
        )

    def __repr__(self) -> str:
        return f"<stand-in {self._qualname}>"


class StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = StandInModule(spec.name)
        module.__path__ = []  # a package: submodules resolve through the finder too
        module.__file__ = None
        module.__standin__ = True
        return module

    def exec_module(self, module) -> None:
        _modules_created.append(module.__name__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in ROOTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


_FINDER = _Finder()


def install() -> None:
    """Append the finder to sys.meta_path (idempotent). Real packages, found by earlier finders,
    take precedence."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def on_call(listener) -> None:
    """`listener(name)` runs on every stand-in call, just before the call raises."""
    if listener not in _call_listeners:
        _call_listeners.append(listener)


def calls() -> dict[str, int]:
    """Stand-in name -> how many times it was called (each call raised)."""
    return dict(_calls)


def reset_calls() -> None:
    _calls.clear()


def modules_created() -> list[str]:
    """The stand-in modules imported so far (a real package would not appear here)."""
    return list(_modules_created)


def is_standin_error(exc: BaseException) -> bool:
    """True when `exc` (or its cause/context chain) is a stand-in call."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StandInCalled):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
