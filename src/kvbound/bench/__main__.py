"""``python -m kvbound.bench``: see :mod:`kvbound.bench.cli`."""

from kvbound.bench.cli import main

raise SystemExit(main())
