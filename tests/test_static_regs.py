"""benchmarks/static_regs.py: the dense kernel compiled for sm_90 on this CPU machine (Triton's ptxas and cuobjdump),
read back as registers, stack and SASS counts."""

import csv
import os
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).parents[1] / "benchmarks" / "static_regs.py"


def _run(tmp_path, *args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "regs.csv"
    proc = subprocess.run([sys.executable, str(_PATH), str(out), *args], capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    return proc, out


def test_compiles_plain_and_relative_keys_for_sm90(tmp_path):
    # TRITON_INTERPRET=1 in the environment (as on this machine's test runs) must not turn the compile into
    # interpretation
    proc, out = _run(tmp_path, "--layers", "enformer", "--tiles", "64x64x8x3", "--commit", "abc1234", interpret=True)
    # (the runs variant as well: its launcher arguments are the ones kvbound.attention builds)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    plain, keys, runs = list(csv.DictReader(out.open()))
    for row in (plain, keys, runs):
        assert row["status"] == "ok" and row["tile"] == "64x64x8x3" and row["commit"] == "abc1234"
        assert 0 < int(row["registers"]) <= 255 and int(row["hgmma"]) > 0  # Hopper tensor-core instructions
        assert row["use_tma"] == "1"  # K/V through tensor descriptors, as the launcher does on an H200
        # three stages of K and V tiles (64 x 64 and 64 x 192 bf16) at least
        assert int(row["shared_bytes"]) >= 3 * 64 * (64 + 192) * 2
    # the relative term adds the window product and its skew: more tensor-core and other instructions
    assert int(keys["hgmma"]) > int(plain["hgmma"]) and int(keys["sass_instructions"]) > int(plain["sass_instructions"])
    # the runs need no window product (the tensor-core work of plain attention in the key loop, plus the
    # prologue's small product that writes the program's rows of the table of run logits; how many HGMMA the
    # compiler emits for these depends on its version) but more other instructions: the runs' compares and selects
    assert int(runs["sass_instructions"]) > int(plain["sass_instructions"])


def test_refuses_bad_tiles(tmp_path):
    proc, _ = _run(tmp_path, "--tiles", "64x64")
    assert proc.returncode == 2 and "BMxBNxWARPSxSTAGES" in proc.stderr


def test_a_tile_past_the_shared_memory_of_an_sm_is_an_error_row(tmp_path):
    proc, out = _run(tmp_path, "--layers", "enformer", "--variants", "keys", "--tiles", "64x64x8x4")
    assert proc.returncode == 1
    (row,) = list(csv.DictReader(out.open()))
    assert row["status"] == "error" and int(row["shared_bytes"]) > 232448 and "cannot launch" in row["reason"]


_COMPRESSED_PATH = Path(__file__).parents[1] / "benchmarks" / "static_regs_compressed.py"


def test_compressed_kernel_without_general_runs_compiles_smaller_for_sm90(tmp_path):
    """AlphaGenome's shape with K and V packed at 8 bits: the kernel without its general-run loop is smaller and
    keeps less on the stack (spilled registers) than the one with it, and the value columns in two parts (dv 192 as
    128 + 64) keep less there and store fewer registers than one part padded to 256, with or without that loop."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "regs.csv"
    proc = subprocess.run([sys.executable, str(_COMPRESSED_PATH), str(out), "--tiles", "128x64x8x3", "--commit",
                           "abc1234"], capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {(r["general_runs"], r["dv_split"]): r for r in csv.DictReader(out.open())}
    assert sorted(rows) == [("off", "off"), ("off", "on"), ("on", "off"), ("on", "on")]
    for (general, split), row in rows.items():
        assert row["status"] == "ok" and row["commit"] == "abc1234" and int(row["hgmma"]) > 0
        assert "FAST_BITS_K=8 FAST_BITS_V=8" in row["constexprs"] and "USE_TMA=True" in row["constexprs"]
        assert f"GENERAL_RUNS={general == 'on'}" in row["constexprs"]
        assert ("DV_PAD=128 DV_HI=64" if split == "on" else "DV_PAD=256 DV_HI=0") in row["constexprs"]
    for split in ("off", "on"):
        with_general, without = rows["on", split], rows["off", split]
        assert int(without["sass_instructions"]) < int(with_general["sass_instructions"])
        assert int(without["stack_bytes"]) < int(with_general["stack_bytes"])
    for general in ("off", "on"):
        whole, parts = rows[general, "off"], rows[general, "on"]
        assert int(parts["stack_bytes"]) < int(whole["stack_bytes"]) and int(parts["stl"]) < int(whole["stl"])
