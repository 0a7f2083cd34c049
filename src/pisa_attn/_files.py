"""Writing a file whole or not at all."""

from __future__ import annotations

import os
from typing import Callable


def write_replacing(path, write: Callable[[str], object]) -> str:
    """``write(tmp)`` to a temporary path beside ``path``, then rename it over ``path``: a write that
    fails part-way (a full disk, an interrupt) leaves an existing file as it was and no temporary
    file behind. Returns ``path`` as a str."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
