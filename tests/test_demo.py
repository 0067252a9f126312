import re

import pytest
import torch

from kvbound import cli, demo
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


def test_cli_without_a_command_prints_usage_on_stderr_and_version(capsys):
    from importlib.metadata import version

    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: kvbound" in captured.err and "expected a command (one of demo, bench" in captured.err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvbound {version('kvbound')}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "0"], r"argument --tokens: expected a positive integer, got 0"),
        (["--tokens", "-5"], r"argument --tokens: expected a positive integer, got -5"),
        (["--tokens", "many"], r"argument --tokens: expected a positive integer, got 'many'"),
        (["--device", "bogus"], r"argument --device: expected cpu, cuda or cuda:N, got 'bogus'"),
        (["--device", "cuda:x"], r"argument --device: expected cpu, cuda or cuda:N, got 'cuda:x'"),
        (["--device", "cuda:99"], None),  # no CUDA device present, or fewer than 100
    ],
)
def test_demo_rejects_bad_arguments_with_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    if message is None:
        message = (r"argument --device: no CUDA device is present .*expected cpu, got 'cuda:99'"
                   if not torch.cuda.is_available() else r"argument --device: expected cuda:N with N < \d+")
    assert re.search(message, err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed when no CUDA device is present")
def test_demo_refuses_cuda_without_a_cuda_device(capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(["--device", "cuda", "--tokens", "1"])
    assert info.value.code == 2
    assert re.search(r"argument --device: no CUDA device is present .*: expected cpu, got 'cuda'",
                     capsys.readouterr().err)
