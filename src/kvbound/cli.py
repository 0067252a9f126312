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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvbound COMMAND [options]\n\ncommands:")
        for name, (_, text) in _COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"kvbound: unknown command {name!r}; expected one of {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
