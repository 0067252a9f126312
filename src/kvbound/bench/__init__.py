"""Benchmarks of kvbound's attention against the stock kernels, measured traffic, roofline, plots and report.

Entry points (each a ``main(argv=None) -> int``):

* ``kvbound.bench.cli.main``       ``python -m kvbound.bench`` / ``kvbound bench``: time every provider on the
                                   shape lists in ``benchmarks/shapes/``; ``--ncu`` records DRAM/L2 bytes;
                                   ``--suite encoder|models|ring`` the encoders, the genomic ports end to end and
                                   context-parallel attention.
* ``kvbound.bench.roofline.main``  ``python -m kvbound.bench.roofline`` / ``kvbound roofline``: the card's
                                   copy bandwidth and bf16 matmul rate, and each provider against them.
* ``kvbound.bench.plots.main``     ``python -m kvbound.bench.plots``: PNGs from result CSVs.
* ``kvbound.bench.report.main``    ``python -m kvbound.bench.report``: BENCHMARKS.md from committed CSVs.

Modules: ``shapes`` (shape files), ``data`` (structured K/V, queries, biases), ``providers`` (the
implementations), ``runner`` (check, time, profile), ``encoder``, ``ports`` and ``ring`` (the other suites),
``formulas`` (FLOP and byte counts), ``records`` (the CSV schema), ``ncu`` (Nsight Compute), ``tables``
(ablation, sweep, data movement, overhead, and one table per suite), ``summary``.
"""
