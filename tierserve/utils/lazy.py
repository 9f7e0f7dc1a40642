"""Packages name what outsiders import in their `__init__` without importing it there: a name
is loaded from its module on first use, so `import tierserve.engine.worker` loads no torch
before the worker has armed its parent-death signal, and `tierserve plan` loads no engine."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `name` from `package.<exports[name]>` when asked."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
