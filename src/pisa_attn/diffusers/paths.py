"""Output paths checked where they enter (``capture_qkv(path=)``, ``report(heatmap=)``), so a bad
one fails before a pipeline runs or a table prints, not when the file is finally written."""

from __future__ import annotations

import os


def check_output_path(path, name: str) -> str:
    """``path`` as a str; TypeError/ValueError naming ``name`` unless it is a file path whose
    directory exists and is writable."""
    if isinstance(path, bool) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} must be a file path, got {type(path).__name__}")
    path = os.fsdecode(os.fspath(path))
    if not path:
        raise ValueError(f"{name} must be a file path, got an empty string")
    if os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{name} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{name} {path!r} is not writable")
    return path
