"""A bounded cache for what calls keep per shape (plans with their workspaces, token layouts)."""

from __future__ import annotations

from collections import OrderedDict


class LRU(OrderedDict):
    """A dict of at most ``limit`` entries: ``get`` marks an entry recently used, and setting one
    past the limit drops the least recently used. A process that meets many shapes (a server at
    many resolutions) keeps the recent ones' plans and buffers, not every one it ever saw."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        super().__init__()
        self.limit = limit

    def get(self, key, default=None):
        try:  # one lookup on a hit (the call path's case)
            self.move_to_end(key)
        except KeyError:
            return default
        return self[key]

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)
