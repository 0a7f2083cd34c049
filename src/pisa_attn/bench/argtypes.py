"""``argparse`` value types shared by the ``pisa-attn`` commands.

Each one rejects a bad value with ``argparse.ArgumentTypeError``, so the command stops with
``error: argument --flag: ...`` (exit 2) before any work starts. No torch import here: the parsers
are built before the command's work is.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import re


def _accepts(text: str):
    """Tag a value type with what it accepts; :class:`HelpFormatter` shows it in ``--help``."""

    def tag(fn):
        fn.accepts = text
        return fn

    return tag


def int_at_least(low: int):
    @_accepts(f"an integer >= {low}")
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _number(text: str, ok, why: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{why}, got {text}")
    return value


@_accepts("a finite number > 0")
def positive_float(text: str) -> float:
    return _number(text, lambda x: 0 < x < float("inf"), "must be a finite number > 0")  # nan fails both


@_accepts("a number in (0, 1]")
def density(text: str) -> float:
    return _number(text, lambda x: 0.0 < x <= 1.0, "density must be in (0, 1]")


@_accepts("a power of two >= 16")
def block_size(text: str) -> int:
    value = int_at_least(16)(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"block size must be a power of two >= 16, got {value}")
    return value


@_accepts("an even integer in [16, 256]")
def head_dim(text: str) -> int:
    value = int_at_least(16)(text)
    if value > 256 or value % 2:
        raise argparse.ArgumentTypeError(f"head dim must be even and in [16, 256], got {value}")
    return value


def comma_list(item):
    """``"a,b,c"`` -> a tuple of ``item(a), item(b), item(c)``; at least one entry."""

    @_accepts("comma-separated, each " + getattr(item, "accepts", "a name"))
    def parse(text: str) -> tuple:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(item(x) for x in parts)

    return parse


def one_of(choices: tuple[str, ...]):
    @_accepts("one of " + ", ".join(choices))
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


@_accepts("an existing file")
def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r} (no such file)")
    return text


def existing_file_or(word: str):
    """``word`` itself, or the path of a file that exists."""

    @_accepts(f"{word!r} or an existing file")
    def parse(text: str) -> str:
        if text != word and not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"expected {word!r} or an existing file, got {text!r} (no such file)")
        return text

    return parse


def _writable_dir(path: str) -> str | None:
    """Why files cannot be created in directory ``path`` (created on demand), or None."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest ancestor that exists decides
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe!r} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe!r} is not writable"
    return None


@_accepts("a directory (created if missing)")
def output_dir(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    why = _writable_dir(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"cannot create files in {text!r}: {why}")
    return text


@_accepts("a file path in an existing directory")
def output_file(text: str) -> str:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the directory of {text!r} is not writable")
    return text


# the formats matplotlib's savefig writes without external programs (a name without a suffix is
# written as PNG; pgf needs a TeX installation, found only after the work)
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "raw", "rgba")


def plot_file(text: str) -> str:
    """An :func:`output_file` whose suffix names an image format matplotlib writes (checked before
    the work whose result it plots)."""
    text = output_file(text)
    suffix = os.path.splitext(text)[1].lower().lstrip(".")
    if suffix and suffix not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: the plot's format {suffix!r} is not one of {', '.join(PLOT_FORMATS)}")
    return text


def distinct_outputs(**paths) -> None:
    """ValueError when two of the named output paths (None: not asked for) are one file."""
    seen = {}
    for name, path in paths.items():
        if path is None:
            continue
        key = os.path.abspath(path)
        if key in seen:
            raise ValueError(f"--{seen[key]} and --{name} are the same file {path!r}")
        seen[key] = name


def missing_modules(*names: str) -> list[str]:
    """The top-level modules among ``names`` that cannot be imported here (without importing them)."""
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


def plain(doc: str | None) -> str | None:
    """A docstring as ``--help`` text: reStructuredText roles and literals as plain words."""
    if doc is None:
        return None
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    return text.replace("``", "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (line breaks kept); every option's help says what it accepts and
    its default, so ``--help`` lists the choices of ``--mode``, ``--seed``, ``--block-size``..."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""  # may hold %(default)s-style fields: what is added is escaped
        if text == argparse.SUPPRESS:
            return text
        more = []
        accepts = getattr(action.type, "accepts", None)
        if accepts and accepts not in text:
            more.append(accepts)
        default = action.default
        if (action.option_strings and action.nargs != 0 and not any(default is x for x in (None, False, True, argparse.SUPPRESS))
                and "default" not in text):
            shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
            more.append(f"default: {shown}")
        if not more:
            return text
        added = "; ".join(more).replace("%", "%%")
        return f"{text} ({added})" if text else added

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:  # argparse lists such an option bare
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)
