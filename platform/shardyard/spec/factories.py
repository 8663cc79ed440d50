"""A function of the user's, named in a spec as 'package.module:function': checked to exist when
the spec is validated (before any worker starts), called where the thing it makes is needed."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# Where shardyard finds the user's code, for the message when it does not.
WHERE_CODE_IS_FOUND = ("shardyard imports it from the directory it runs in, an installed package or PYTHONPATH; on "
                       "a cluster, submit the job with `ray job submit --working-dir .` or name the package in Ray's "
                       "runtime environment (py_modules)")


def check_factory(key: str, reference: str) -> None:
    """Raises ValueError, naming `key`, unless `reference` names a callable that can be imported."""
    module, _, function = reference.partition(":")
    if not module or not function:
        raise ValueError(f"{key} must be 'package.module:function', got '{reference}'")
    try:
        found = getattr(importlib.import_module(module), function, None)
    except ImportError as err:
        raise ValueError(f"{key}: cannot import '{module}': {err} ({WHERE_CODE_IS_FOUND})") from None
    if not callable(found):
        raise ValueError(f"{key}: '{module}' has no function '{function}'")


def load_factory(reference: str) -> Callable[..., Any]:
    """The function `reference` names (checked by check_factory when the spec was validated)."""
    module, _, function = reference.partition(":")
    return getattr(importlib.import_module(module), function)
