"""``pisa-attn`` command line: ``demo``, ``bench``, ``study``, ``calibrate``, ``generate``.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``. Only the module of the
command being run is imported (``generate`` pulls in diffusers, ``bench`` needs CUDA + Triton), and
a module that fails to import turns into a subcommand that says what is missing instead of
breaking the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from . import __version__


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    summary: str
    needs: str  # what the module needs beyond the core install, for the "unavailable" message


COMMANDS = (
    Command("demo", "pisa_attn.bench.demo", "accuracy/time of every PISA mode vs dense on DiT-like data (CPU ok)",
            "the core install"),
    Command("bench", "pisa_attn.bench.kernels", "kernel latency of PISA vs dense attention (CUDA)",
            "a CUDA GPU with triton"),
    Command("study", "pisa_attn.bench.study", "accuracy study: error vs density/length, tail mass, tiling",
            "matplotlib (pip install 'pisa-attn[plot]')"),
    Command("calibrate", "pisa_attn.bench.calibrate",
            "fit the first-order tail weight per layer/head from a q/k/v capture (for apply_pisa)",
            "safetensors (pip install safetensors) and rich"),
    Command("generate", "pisa_attn.bench.generate", "generate images/videos with a diffusers pipeline + PISA",
            "diffusers, transformers, safetensors (pip install 'pisa-attn[diffusers]')"),
)


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first non-option word), if any."""
    names = {c.name for c in COMMANDS}
    for word in argv:
        if not word.startswith("-"):
            return word if word in names else None
    return None


def _unavailable(cmd: Command, error: ImportError | None):
    def run(args: argparse.Namespace) -> int:
        missing = getattr(error, "name", None) or ""
        if error is None:
            why = f"{cmd.module} defines no add_parser(subparsers)"
        elif cmd.module == missing or cmd.module.startswith(missing + "."):
            why = f"{cmd.module} is not part of this installation of pisa-attn"
        else:
            why = f"{cmd.module} could not be imported ({type(error).__name__}: {error}); it needs {cmd.needs}"
        print(f"pisa-attn {cmd.name}: unavailable: {why}", file=sys.stderr)
        return 1

    return run


def _register(subparsers, cmd: Command) -> None:
    error = None
    try:
        add_parser = getattr(importlib.import_module(cmd.module), "add_parser", None)
    except ImportError as e:  # not written yet, or an optional dependency is missing
        add_parser, error = None, e
    if add_parser is None:
        p = subparsers.add_parser(cmd.name, help=f"{cmd.summary} [unavailable]", add_help=False)
        p.set_defaults(func=_unavailable(cmd, error), _accepts_any=True)
        return
    add_parser(subparsers)
    _plain_help(subparsers.choices[cmd.name])


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """One ``--help`` style for every command: the module docstring without reStructuredText
    markup, and each option's accepted values and default."""
    from .bench import argtypes  # no torch: cheap

    parser.description = argtypes.plain(parser.description)
    parser.formatter_class = argtypes.HelpFormatter


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only the subcommand chosen in ``argv`` gets its full parser."""
    parser = argparse.ArgumentParser(
        prog="pisa-attn",
        description="PISA: Piecewise Sparse Attention for diffusion transformers.",
        epilog="Run 'pisa-attn COMMAND --help' for a command's options. Start with 'pisa-attn demo'.",
    )
    parser.add_argument("--version", action="version", version=f"pisa-attn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    parser.commands = sub  # main reports a command's errors with that command's usage line
    chosen = _chosen(sys.argv[1:] if argv is None else list(argv))
    for cmd in COMMANDS:
        if cmd.name == chosen:
            _register(sub, cmd)
        else:  # listed in --help without importing its module
            sub.add_parser(cmd.name, help=cmd.summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 0
    if extra and not getattr(args, "_accepts_any", False):
        # the command's own usage line, as argparse gives for its other errors
        parser.commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
