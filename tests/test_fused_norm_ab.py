"""benchmarks/fused_norm_ab.py without a GPU: it refuses, writes nothing, and says why."""

import torch

from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)


def test_without_cuda_it_refuses_and_writes_nothing(monkeypatch, tmp_path, capsys):
    script = load("fused_norm_ab")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "ab.csv"
    assert script.main([str(out)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err and not out.exists()
    from kvbound.bench import report

    assert script.FIELDS == list(report.FUSED_NORM_COLUMNS)  # the report recognises its CSVs by these columns
