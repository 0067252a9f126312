"""Offline biological-quality benchmark for compressed K/V attention.

Real human sequence (chrX, GRCh37), real motifs (JASPAR 2024) and real TSS positions are turned into
ground-truth tracks by a documented simulator (:mod:`kvbound.eval.simulate`); compact Enformer-style and
AlphaGenome-style models (:mod:`kvbound.eval.models`) are trained on them (:mod:`kvbound.eval.train`) and
evaluated with exact and compressed K/V (:mod:`kvbound.eval.cli`).

Modules:
    data      fetch, cache and parse the real data; write the synthetic fixture used by the tests.
    simulate  motif occupancy -> enhancer activity -> expression at 128 bp bins; train/test split.
    variants  enhancer-breaking SNVs (positives) and distance-matched SNVs (negatives).
    windows   window sampling and per-track normalisation shared by training and evaluation.
    models    the compact models, with a K/V hook on every attention layer.
    kv_hooks  per-instance patching of those hooks (compressed K/V, low-rank-only ablation).
    metrics   Pearson per track and AUROC, stratified by distance.
    train     ``python -m kvbound.eval.train``.
    cli       ``kvbound eval`` (``main(argv)``).
    fidelity  ``python -m kvbound.eval.fidelity``: the public ports under ``kvbound.patch`` on real DNA.
    report    ``python -m kvbound.eval.report``: EVAL.md from the result files.
"""
