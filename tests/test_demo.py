import torch

from kvbound import cli
from kvbound.demo import run


def test_demo_rows_hold_the_bound_and_beat_bf16_noise():
    rows = run(tokens=256, dtype=torch.bfloat16, device="cpu")
    assert len(rows) >= 6
    for r in rows:
        assert r["max_error"] <= r["tau"]
        assert r["ratio"] > 1.0
        # every element of the attention output on the decompressed K/V is within its certified bound
        assert r["within_output_bound"], r
        assert r["output_error"] <= r["output_bound"]
    default = next(r for r in rows if r["note"] == "default")
    assert default["output_error"] < default["plain_error"], default


def test_cli_dispatch(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main(["nonsense"]) == 2
