"""The ``kvbound`` command: ``kvbound demo | bench | roofline | eval``."""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "demo": ("kvbound.demo", "compress K/V with real structure and show ratio, bound and attention error"),
    "bench": ("kvbound.bench.cli", "time attention, encoders, patched models or the ring side by side; CSV rows"),
    "roofline": ("kvbound.bench.roofline", "measure the card's ceilings and place each provider on a roofline"),
    "eval": ("kvbound.eval.cli", "expression Pearson and variant AUROC with exact and compressed K/V"),
}


def _usage(file) -> None:
    print("usage: kvbound [--version] COMMAND [options]\n\ncommands:", file=file)
    for name, (_, text) in _COMMANDS.items():
        print(f"  {name:10s} {text}", file=file)


def _version() -> str:
    """The installed distribution's version (the source tree's when kvbound is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvbound")
    except PackageNotFoundError:
        from kvbound import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        _usage(sys.stderr)
        print(f"kvbound: expected a command (one of {', '.join(_COMMANDS)}), got none", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        _usage(sys.stdout)
        return 0
    if argv[0] == "--version":
        print(f"kvbound {_version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"kvbound: unknown command {name!r}; expected one of {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
