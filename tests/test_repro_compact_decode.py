"""benchmarks/repro_compact_decode.py on the CPU (Triton's interpreter): its packing, its kernel and its check."""

from __future__ import annotations

import pytest
import torch

from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)

repro = load("repro_compact_decode")


def test_pack_places_code_d_in_slot_d_mod_per_word():
    codes = torch.tensor([[-8, 7, 0, 1, -1, 2, 3, -4]])
    (word,) = repro.pack(codes, 4)[0].tolist()
    nibbles = [((word & 0xFFFFFFFF) >> (4 * slot)) & 15 for slot in range(8)]
    assert [n - 8 for n in nibbles] == codes[0].tolist()


@pytest.mark.parametrize("decode", ["compact", "bytes"])
def test_every_cpu_configuration_passes_and_a_wrong_layout_fails(monkeypatch, decode):
    for config in repro.CPU_CONFIGS:
        ok, message = repro.check(config, "cpu", decode)
        assert ok, (config, message)
    original = repro.pack
    monkeypatch.setattr(repro, "pack", lambda codes, width: original(codes.flip(-1), width))
    ok, message = repro.check(repro.CPU_CONFIGS[0], "cpu", decode)
    assert not ok and "max err" in message
