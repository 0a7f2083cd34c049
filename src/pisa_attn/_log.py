"""The library's logger and its say-once helper (a fallback or a slower path is reported once per
process, not once per call)."""

from __future__ import annotations

import logging

log = logging.getLogger("pisa_attn")
_said: set[str] = set()


def log_once(msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` at ``level`` the first time it is given."""
    if msg not in _said:
        _said.add(msg)
        log.log(level, msg)
