"""``kvbound bench --suite models`` on the CPU: the timing hooks, the row formulas, and the tiny ports end to end.

The end-to-end test needs the ports (``pip install -e ".[models]"`` plus borzoi-pytorch and alphagenome-pytorch,
README "Model ports") and skips with that reason when they are absent.
"""

import dataclasses
import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import kvbound
from kvbound.bench import cli, ports, records, tables

SMOKE = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
OPTIONS = ports.ModelOptions(warmup=0, repeats=1, batches=(1,))


class Sleepy(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x + 1


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Sleepy(0.01), Sleepy(0.02)])
        self.other = Sleepy(0.05)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.other(x)


def test_attention_timer_sums_the_hooked_modules_only():
    model = Toy()
    with ports.AttentionTimer(list(model.blocks), torch.device("cpu")) as timer:
        model(torch.zeros(1))
        first = timer.total_ms()
        timer.reset()
        model(torch.zeros(1))
        assert len(timer.calls) == 2
        second = timer.total_ms()
    print(f"hooked modules: {first:.1f} ms, {second:.1f} ms (sleeps of 30 ms, 50 ms outside)")
    assert 30.0 <= first < 80.0 and 30.0 <= second < 80.0  # 80 ms or more: the unhooked module was counted
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in model.blocks)


def test_compressed_ratio_weights_k_and_v_by_their_bytes():
    class Record:
        def __init__(self, k, v):
            self.module, self.last_k_ratio, self.last_v_ratio = None, k, v

    def describe(_):
        return 8, 1, 128, 192

    # dense 320 units per layer; stored 128 / 4 + 192 / 2 = 128
    assert ports.compressed_ratio([Record(4.0, 2.0), Record(4.0, 2.0)], describe) == pytest.approx(320 / 128)
    assert ports.compressed_ratio([Record(None, None)], describe) is None


def test_difference_is_max_abs_and_relative_l2():
    ref = torch.tensor([3.0, 4.0])
    got = ports._difference(torch.tensor([3.0, 4.5]), ref)
    assert got == {"diff_max_abs": 0.5, "diff_rel": pytest.approx(0.1)}
    with pytest.raises(ValueError, match="expected shape"):
        ports._difference(torch.zeros(3), ref)


def _toy_spec(**kw):
    base = dict(
        name="toy", package="torch", distribution="torch", input_len=4, tokens=4, batches=(1, 3),
        build=lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval(),
        make_input=lambda b, seed, device: ports.Inputs(
            (torch.randn(b, 4, generator=torch.Generator().manual_seed(seed)),)),
        output=lambda y: y, attention_class=lambda: nn.Linear, describe=lambda m: (1, 1, 4, 4), note="toy")
    base.update(kw)
    return ports.PortModel(**base)


def test_rows_for_a_model_without_port_modules(tmp_path):
    rows = list(ports.model_rows((_toy_spec(),), torch.device("cpu"), SMOKE,
                                 ports.ModelOptions(warmup=1, repeats=3)))
    assert [(r["batch"], r["provider"]) for r in rows] == [(b, v) for b in (1, 3) for v in ports.VARIANTS]
    for r in rows:
        assert r["status"] == "ok", r["reason"]
        assert r["mode"] == "model" and r["suite"] == "models" and r["repeats"] == 3 and r["layers"] in (0, 2)
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["attention_ms_p20"] <= r["attention_ms_p50"] <= r["attention_ms_p80"]
        assert r.get("peak_bytes") is None  # CUDA only
    unpatched = [r for r in rows if r["provider"] == "unpatched"]
    assert all(r["layers"] == 2 and r["ref_max_abs"] > 0 and r.get("diff_rel") is None for r in unpatched)
    patched = [r for r in rows if r["provider"] != "unpatched"]
    # kvbound.patch finds no port module in a plain MLP: same function, so exactly the same output
    assert all(r["layers"] == 0 and r["diff_max_abs"] == 0.0 and r["diff_rel"] == 0.0 for r in patched)
    assert all(r["config"] == "r4b4-block16" for r in rows if r["provider"] == "patch-compressed")
    records.write_rows(tmp_path / "m.csv", rows)
    headers, body = tables.models_table(records.read_rows(tmp_path / "m.csv"))
    assert len(body) == 6 and dict(zip(headers, body[0], strict=True))["vs unpatched"] == "1.00x"


def test_calibrations_freed_blocks_are_released_before_the_batchs_forwards(monkeypatch):
    """The compressed variant calibrates on a batch-1 forward; the allocator's cache is emptied after it, before the
    variant's forwards at the measured batch (which would otherwise be carved out of the freed batch-1 blocks)."""
    events = []
    original_forward = ports._forward

    def forward(spec, model, inputs, device):
        events.append(f"forward {inputs.args[0].shape[0]}")
        return original_forward(spec, model, inputs, device)

    monkeypatch.setattr(ports, "_forward", forward)
    monkeypatch.setattr(ports, "_release", lambda device: events.append("release"))
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(3,), variants=("patch-compressed",))
    rows = list(ports.model_rows((_toy_spec(),), torch.device("cpu"), SMOKE, options))
    assert [r["status"] for r in rows] == ["ok"]
    first = events.index("forward 1")  # the calibration forward
    assert events[first + 1] == "release" and events[first + 2] == "forward 3"


def test_graph_variants_are_unsupported_without_cuda():
    """``--graphs`` adds the three graph variants (unpatched, dense, compressed) after the three others; on the CPU
    they are ``unsupported`` rows that say why, and the other variants run as before."""
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), graphs=True)
    rows = list(ports.model_rows((_toy_spec(),), torch.device("cpu"), SMOKE, options))
    assert [r["provider"] for r in rows] == [*ports.VARIANTS, "unpatched-graph", "patch-dense-graph",
                                             "patch-compressed-graph"]  # fmt: skip
    assert [r["status"] for r in rows] == ["ok"] * 3 + ["unsupported"] * 3
    assert all(r["reason"] == "CUDA graphs need a CUDA device" for r in rows[3:])


def test_missing_port_gives_unsupported_rows():
    spec = _toy_spec(package="kvbound_no_such_port", distribution="no-such-port==1.0")
    rows = list(ports.model_rows((spec,), torch.device("cpu"), SMOKE, OPTIONS))
    assert len(rows) == 3 and all(r["status"] == "unsupported" for r in rows)
    assert "no-such-port==1.0" in rows[0]["reason"] and "wheels.sh" in rows[0]["reason"]


def test_a_failing_build_is_recorded():
    def broken():
        raise RuntimeError("no weights")

    rows = list(ports.model_rows((_toy_spec(build=broken),), torch.device("cpu"), SMOKE, OPTIONS))
    assert all(r["status"] == "error" and "no weights" in r["reason"] for r in rows)


def test_lean_variants_still_run_when_the_unpatched_forward_fails():
    calls = []

    def output(y):  # the first forward (the unpatched reference) runs out of memory, the later ones do not
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("the N x N logits do not fit")
        return y

    rows = list(ports.model_rows((_toy_spec(output=output),), torch.device("cpu"), SMOKE, OPTIONS))
    assert [r["status"] for r in rows] == ["error", "ok", "ok"]
    assert "MemoryError: the N x N logits do not fit" in rows[0]["reason"]
    for r in rows[1:]:
        assert r["ms_p50"] > 0 and r.get("diff_rel") is None
        assert r["note"].startswith("no output difference: the unpatched forward failed (MemoryError")


_PORTS = ("enformer_pytorch", "borzoi_pytorch", "alphagenome_pytorch")
_MISSING = [name for name in _PORTS if importlib.util.find_spec(name) is None]


@pytest.fixture()
def one_thread():
    """Tiny ops on a shared 2-core machine: one intra-op thread avoids thread pools spinning at their barriers
    (measured: 10 s instead of 50 s for this test with another process busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(bool(_MISSING), reason=f"ports not installed: {_MISSING} (README, 'Model ports')")
def test_tiny_ports_end_to_end(one_thread):
    rows = list(ports.model_rows(ports.SMOKE_PORT_MODELS, torch.device("cpu"), SMOKE, OPTIONS))
    assert [(r["shape"], r["provider"]) for r in rows] == [
        (spec.name, variant) for spec in ports.SMOKE_PORT_MODELS for variant in ports.VARIANTS]
    for r in rows:
        print(f"{r['shape']:24s} {r['provider']:17s} {r['status']} forward {r.get('ms_p50')} ms, attention "
              f"{r.get('attention_ms_p50')} ms, diff {r.get('diff_max_abs')} (rel {r.get('diff_rel')}), "
              f"ratio {r.get('compression_ratio')}")
        assert r["status"] == "ok", (r["shape"], r["provider"], r["reason"])
        assert r["layers"] == {"enformer-tiny": 2, "borzoi-tiny": 2, "alphagenome-tower-tiny": 9}[r["shape"]]
        assert r["attention_ms_p50"] > 0 and r["ms_p50"] > 0
    by = {(r["shape"], r["provider"]): r for r in rows}
    for spec in ports.SMOKE_PORT_MODELS:
        dense, compressed = by[(spec.name, "patch-dense")], by[(spec.name, "patch-compressed")]
        scale = by[(spec.name, "unpatched")]["ref_max_abs"]
        assert scale > 0
        # bf16 autocast: the lean forward rounds differently from the port, not more
        assert dense["diff_rel"] < 2e-2, dense
        assert compressed["diff_rel"] < 5e-2 and math.isfinite(compressed["diff_max_abs"])
        assert compressed["compression_ratio"] > 1 and compressed["calibration_ms"] > 0
        assert compressed["compress_ms"] > 0 and dense.get("compression_ratio") is None
        for role in ("k", "v"):  # blocks per storage mode, counted in the encode-timing forwards
            shares = [compressed[f"{role}_share_{name}"] for name in ports.MODE_NAMES]
            assert all(0 <= x <= 1 for x in shares) and sum(shares) == pytest.approx(1.0), shares
            assert dense.get(f"{role}_share_lowrank") is None
        assert compressed["note"].endswith("synchronous encoding")  # the CPU's eager encoder reads in every layer
    assert by[("alphagenome-tower-tiny", "unpatched")]["kv_heads"] == 1


def test_cli_models_rejects_unknown_names(tmp_path):
    assert cli.main(["--suite", "models", "--cpu-smoke", "--only", "gpt*", "--out", str(tmp_path / "m.csv")]) == 2
    assert not (tmp_path / "m.csv").exists()


@pytest.mark.parametrize(("flags", "widen"), [([], True), (["--fixed-widths"], False)])
def test_cli_fixed_widths_turns_the_patchs_calibrated_widths_off(monkeypatch, flags, widen):
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(ports, "model_rows", lambda specs, device, config, options: seen.append(options) or iter(()))
    args = cli.build_parser().parse_args(["--suite", "models", "--cpu-smoke", "--only", "enformer*", *flags])
    cli._suite_rows(args, torch.device("cpu"), SimpleNamespace(print=print))
    assert [o.widen_codes for o in seen] == [widen]


@pytest.mark.parametrize("widen", [True, False])
def test_widen_codes_option_reaches_the_compressed_patch(monkeypatch, widen):
    import kvbound

    seen = []
    original = kvbound.patch

    def spy(*args, **kwargs):
        seen.append((kwargs.get("compress"), kwargs.get("widen_codes")))
        return original(*args, **kwargs)

    monkeypatch.setattr(kvbound, "patch", spy)
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), widen_codes=widen)
    rows = list(ports.model_rows((_toy_spec(),), torch.device("cpu"), SMOKE, options))
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert seen == [(False, None), (True, widen)]
    compressed = next(r for r in rows if r["provider"] == "patch-compressed")
    why = "no attention module patched" if widen else "widen_codes off"  # (a plain MLP: nothing to patch)
    assert f"code widths 4 (not calibrated: {why})" in compressed["note"]


def test_cli_models_flag_is_the_models_suite(tmp_path):
    args = cli.build_parser().parse_args(["--models", "--only", "enformer*"])
    assert args.suite == "models" and args.only == ["enformer*"]
    assert cli.build_parser().parse_args([]).suite == "attention"
    # the flag takes the models suite's path: an unknown model name is refused there, as with --suite models
    assert cli.main(["--models", "--cpu-smoke", "--only", "gpt*", "--out", str(tmp_path / "m.csv")]) == 2
    assert not (tmp_path / "m.csv").exists()


def test_port_model_lists():
    assert [s.name for s in ports.port_models(cpu_smoke=False)] == ["enformer", "borzoi", "alphagenome"]
    full = {s.name: s for s in ports.PORT_MODELS}
    assert full["enformer"].input_len // 128 == full["enformer"].tokens == 1536
    assert full["borzoi"].input_len // 128 == full["borzoi"].tokens == 4096
    assert full["alphagenome"].input_len // 128 == full["alphagenome"].tokens == 8192
    assert all(len(s.batches) == 2 and s.batches[0] == 1 for s in ports.PORT_MODELS)
    assert dataclasses.is_dataclass(ports.SMOKE_PORT_MODELS[0])


def test_encoding_notes_say_how_encodes_ran_and_why_forwards_ran_again(monkeypatch):
    """A compressed row's note: the encoder's launch choice (the handle's, else KVBOUND_ONE_PASS_ENCODE's, else the
    size rule) and, after retries, the first flag and the tensors that stopped speculating."""
    from types import SimpleNamespace

    from kvbound.codec.encode_triton import ONE_PASS_AUTO_ELEMENTS

    handle = SimpleNamespace(one_pass_encode=None, retry_reasons=[], synchronous_tensors=[])
    monkeypatch.delenv("KVBOUND_ONE_PASS_ENCODE", raising=False)
    assert ports._one_pass_label(handle) == f"one launch up to {ONE_PASS_AUTO_ELEMENTS} elements, five above"
    monkeypatch.setenv("KVBOUND_ONE_PASS_ENCODE", "0")
    assert ports._one_pass_label(handle) == "five launches"
    handle.one_pass_encode = True
    assert ports._one_pass_label(handle) == "one launch"
    assert ports._retry_label(handle) == ""
    handle.retry_reasons = [["layer 3 K: a residual where none was forecast"], ["later"]]
    handle.synchronous_tensors = [("transformer.1.attn", "v")]
    assert ports._retry_label(handle) == (" (first flag: layer 3 K: a residual where none was forecast; encoded "
                                          "synchronously since: transformer.1.attn V)")


@pytest.mark.parametrize(
    ("largest_that_fits", "limit", "expected"),
    [
        (37, 256, (37, 38)),  # doubling to 64 fails, then bisection between 32 and 64
        (64, 256, (64, 65)),
        (1, 256, (1, 2)),
        (0, 256, (0, 1)),  # not even one fits
        (300, 256, (256, None)),  # the limit is reached
        (300, 100, (100, None)),  # a limit that is not a power of two is tried itself
        (99, 100, (99, 100)),
    ],
)
def test_largest_fitting_doubles_then_bisects(largest_that_fits, limit, expected):
    tried = []

    def fits(n):
        tried.append(n)
        return n <= largest_that_fits

    largest, failing, calls = ports.largest_fitting(fits, limit)
    assert (largest, failing) == expected
    assert calls == len(tried) == len(set(tried))  # no size is tried twice
    assert all(1 <= n <= limit for n in tried)
    assert calls <= 2 * max(1, limit).bit_length() + 1


@pytest.mark.parametrize(("largest", "failing", "expected", "tried"), [
    (16, 32, (24, 25), [24, 28, 26, 25]),  # resumed below a batch that gave no answer: bisection only
    (16, None, (24, 25), [32, 24, 28, 26, 25]),  # resumed above what fitted: doubling goes on from it
    (0, 1, (0, 1), []),  # nothing left to try
])  # fmt: skip
def test_largest_fitting_resumes_from_what_is_known(largest, failing, expected, tried):
    seen = []

    def fits(n):
        seen.append(n)
        return n <= 24

    assert ports.largest_fitting(fits, 256, largest=largest, failing=failing)[:2] == expected
    assert seen == tried
    with pytest.raises(ValueError, match=r"^largest, failing: expected 0 <= largest < failing"):
        ports.largest_fitting(fits, 256, largest=8, failing=8)


def test_largest_fitting_rejects_a_limit_below_one():
    with pytest.raises(ValueError, match="limit: expected >= 1, got 0"):
        ports.largest_fitting(lambda n: True, 0)


def test_largest_batch_rows_stop_where_the_forward_runs_out_of_memory(monkeypatch):
    """Each variant's own search; an out-of-memory forward is a size that does not fit, any other error ends that
    variant with an error row."""
    forward = ports._forward

    def limited(spec, model, inputs, device):
        batch = inputs.args[0].shape[0]
        if batch > 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(spec, model, inputs, device)

    monkeypatch.setattr(ports, "_forward", limited)
    lines = []
    rows = list(ports.largest_batch_rows((_toy_spec(),), torch.device("cpu"), SMOKE, limit=64, progress=lines.append))
    assert [r["variant"] for r in rows] == list(ports.VARIANTS)
    for r in rows:
        assert r["status"] == "ok" and (r["largest_batch"], r["first_out_of_memory"]) == (5, 6), r
        assert r["probes"] == 6 and r["peak_gib"] is None  # 1 2 4 8, then 6 and 5; peak memory on CUDA only
    assert "toy unpatched batch 8: out of memory" in lines and "toy patch-dense batch 5: fits" in lines

    def cublas(spec, model, inputs, device):  # a library's allocation failure counts as out of memory
        if inputs.args[0].shape[0] > 2:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return forward(spec, model, inputs, device)

    monkeypatch.setattr(ports, "_forward", cublas)
    rows = list(ports.largest_batch_rows((_toy_spec(),), torch.device("cpu"), SMOKE, limit=8,
                                         variants=("unpatched",)))  # fmt: skip
    assert (rows[0]["status"], rows[0]["largest_batch"], rows[0]["first_out_of_memory"]) == ("ok", 2, 3)

    def broken(spec, model, inputs, device):  # any other error stops the search, keeping what it found
        if inputs.args[0].shape[0] > 4:
            raise RuntimeError("a shape error")
        return forward(spec, model, inputs, device)

    monkeypatch.setattr(ports, "_forward", broken)
    rows = list(ports.largest_batch_rows((_toy_spec(),), torch.device("cpu"), SMOKE, limit=64,
                                         variants=("unpatched", "patch-dense")))  # fmt: skip
    for row in rows:
        assert row["status"] == "error" and "RuntimeError: a shape error" in row["reason"]
        assert (row["largest_batch"], row["failed_batch"]) == (4, 8) and "first_out_of_memory" not in row


def _child(*lines: str, sleep_before: float = 0.0, sleep_after: float = 0.0, row: dict | None = None,
           code: int = 0, pid_file: Path | None = None, between: float = 0.0) -> list[str]:
    """A stand-in search process: prints ``lines`` (sleeping before the first, ``between`` after each, and after the
    last), then ``row``; writes its pid to ``pid_file``."""
    import json
    import sys

    body = ["import os, sys, time"]
    if pid_file is not None:
        body.append(f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))")
    body.append(f"time.sleep({sleep_before})")
    for line in lines:
        body += [f"print({line!r}, flush=True)", f"time.sleep({between})"]
    body.append(f"time.sleep({sleep_after})")
    if row is not None:
        body.append(f"print({ports.ROW_PREFIX + json.dumps(row)!r}, flush=True)")
    body.append(f"sys.exit({code})")
    return [sys.executable, "-c", "\n".join(body)]


def _gone(pid_file: Path) -> bool:
    import os

    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


def test_watched_search_returns_the_row_and_passes_answers_on():
    shown = []
    row = {"status": "ok", "largest_batch": 2, "probes": 2}
    cmd = _child("m v batch 1: probing", "m v batch 1: fits, peak 1.50 GiB", "m v batch 2: probing",
                 "m v batch 2: out of memory", "a note", row=row)  # fmt: skip
    got = ports.watched_search(cmd, 30.0, progress=shown.append)
    assert got == {**row, "seen_largest": 1, "seen_out_of_memory": 2, "seen_peaks": {1: 1.5}}
    assert shown == ["m v batch 1: fits, peak 1.50 GiB", "m v batch 2: out of memory", "a note"]  # no probe starts


def test_watched_search_ends_a_probe_that_does_not_answer(tmp_path):
    """A forward that never returns: the process is killed after the probe's limit, the row keeps what fitted."""
    pid = tmp_path / "pid"
    cmd = _child("m v batch 1: probing", "m v batch 1: fits", "m v batch 2: probing", sleep_after=60,
                 row={"status": "ok"}, pid_file=pid)  # fmt: skip
    started = time.perf_counter()
    row = ports.watched_search(cmd, 1.0)
    assert time.perf_counter() - started < 20 and _gone(pid)
    assert (row["status"], row["largest_batch"], row["failed_batch"]) == ("timeout", 1, 2)
    assert "batch 2: no answer within 1 s" in row["reason"]


def test_watched_search_limit_runs_from_the_probe_start_whatever_it_prints():
    """Output during a probe (warnings, autotuning) does not extend its limit."""
    cmd = _child("m v batch 4: probing", *[f"warning {i}" for i in range(40)], between=0.1, row={"status": "ok"})
    started = time.perf_counter()
    row = ports.watched_search(cmd, 1.0)
    assert time.perf_counter() - started < 3.5
    assert (row["status"], row["failed_batch"]) == ("timeout", 4)


def test_watched_search_times_only_probes():
    """Building the model or calibrating (no probe in flight) is not cut by the probe limit."""
    row = {"status": "ok", "largest_batch": 1}
    cmd = _child("m v batch 1: probing", "m v batch 1: fits", sleep_before=2.0, row=row)
    assert ports.watched_search(cmd, 0.5)["status"] == "ok"


def test_watched_search_keeps_the_row_of_a_process_slow_to_exit_and_of_an_error(tmp_path):
    """A row printed after a failed probe (not out of memory) is the answer, even if the process then lingers."""
    error = {"status": "error", "largest_batch": 1, "failed_batch": 2, "reason": "RuntimeError: a shape error"}
    cmd = _child("m v batch 1: probing", "m v batch 1: fits", "m v batch 2: probing", row=error)
    assert ports.watched_search(cmd, 1.0)["status"] == "error"
    cmd = _child("m v batch 1: probing", "m v batch 1: fits", "m v batch 2: probing", row=error)
    cmd[-1] = cmd[-1].replace("sys.exit(0)", "time.sleep(3); sys.exit(0)")
    assert ports.watched_search(cmd, 1.0)["reason"] == "RuntimeError: a shape error"


def test_watched_search_survives_bytes_that_are_not_utf8():
    import sys

    cmd = [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'\\xff\\xfe oops\\n'); sys.stdout.flush(); "
           f"print({ports.ROW_PREFIX!r} + '{{\"status\": \"ok\"}}', flush=True)"]  # fmt: skip
    assert ports.watched_search(cmd, 5.0)["status"] == "ok"


def test_watched_search_kills_the_process_when_the_caller_is_interrupted(tmp_path, monkeypatch):
    pid = tmp_path / "pid"
    calls = []

    def interrupt(line):
        calls.append(line)
        raise KeyboardInterrupt

    cmd = _child("a line before the probe", "m v batch 1: probing", sleep_after=60, pid_file=pid)
    with pytest.raises(KeyboardInterrupt):
        ports.watched_search(cmd, None, progress=interrupt)
    assert calls == ["a line before the probe"] and _gone(pid)


def test_watched_search_reports_a_process_that_dies_without_a_row():
    cmd = _child("m v batch 1: probing", "m v batch 1: fits", "m v batch 2: probing", "Traceback: boom", code=3)
    row = ports.watched_search(cmd, 30.0)
    assert (row["status"], row["largest_batch"], row["failed_batch"]) == ("error", 1, 2)
    assert "status 3" in row["reason"] and "Traceback: boom" in row["reason"]


def test_largest_batch_script_resumes_below_a_probe_without_answer(monkeypatch, tmp_path):
    """benchmarks/largest_batch.py: a timed-out probe is an upper bound, the next worker bisects below it; the row
    keeps the largest batch that fitted, its peak, the first timeout and no out-of-memory that was not seen."""
    import argparse

    from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)

    script = load("largest_batch")
    answers = [
        {"status": "timeout", "failed_batch": 32, "reason": "batch 32: no answer", "largest_batch": 16,
         "seen_largest": 16, "seen_out_of_memory": None, "seen_peaks": {16: 31.7}},
        {"status": "timeout", "failed_batch": 28, "reason": "batch 28: no answer", "largest_batch": 24,
         "seen_largest": 24, "seen_out_of_memory": None, "seen_peaks": {24: 52.5}},
        {"status": "ok", "largest_batch": 27, "first_out_of_memory": 28, "probes": 2, "peak_gib": 58.0,
         "seen_largest": 27, "seen_out_of_memory": None, "seen_peaks": {27: 58.0}},
    ]  # fmt: skip
    commands = []

    def scripted(cmd, timeout, progress=None):
        commands.append(cmd)
        return dict(answers[len(commands) - 1])

    monkeypatch.setattr(ports, "watched_search", scripted)
    args = argparse.Namespace(out=tmp_path / "x.csv", commit="abc", cpu_smoke=False, probe_timeout_s=90.0)
    row = script._search(args, "borzoi", "unpatched", 256)
    known = [(c[c.index("--known-largest") + 1], c[c.index("--known-failing") + 1] if "--known-failing" in c else None)
             for c in commands]  # fmt: skip
    assert known == [("0", None), ("16", "32"), ("24", "28")]
    assert (row["status"], row["largest_batch"], row["first_timeout"]) == ("ok", 27, 28)
    assert row["first_out_of_memory"] is None  # the worker's failing bound (28) was a timeout, not out of memory
    assert row["peak_gib"] == "58.00" and row["probes"] == 2 + 2  # the worker's probes and the two that timed out

    answers[2] = {"status": "timeout", "failed_batch": 25, "reason": "batch 25: no answer", "largest_batch": 24,
                  "seen_largest": 24, "seen_out_of_memory": None, "seen_peaks": {}}  # fmt: skip
    commands.clear()
    row = script._search(args, "borzoi", "unpatched", 256)  # 24 fits, 25 gives no answer: nothing left between
    assert len(commands) == 3 and (row["status"], row["largest_batch"], row["first_timeout"]) == ("ok", 24, 25)
    assert row["peak_gib"] == "52.50"


def test_largest_batch_script_names_the_models_when_none_matches(tmp_path, capsys):
    """A model name that matches none (the CPU dry run's models are the ``-tiny`` configs) is refused with the names
    that would run, before anything is built."""
    from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)

    script = load("largest_batch")
    assert script.main([str(tmp_path / "x.csv"), "--cpu-smoke", "--models", "enformer"]) == 2
    err = capsys.readouterr().err
    assert "nothing to run" in err and "models with --cpu-smoke: ['enformer-tiny', 'borzoi-tiny'" in err
    assert not (tmp_path / "x.csv").exists()


def test_out_of_memory_reason_keeps_the_allocators_figures():
    """The reason of a row that ran out of memory keeps what is needed to tell fragmentation from a forward that
    does not fit (the reserved-but-unallocated memory), and drops the allocator's advice."""
    message = ("CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
               "29.94 GiB is free. Including non-PyTorch memory, this process has 109.85 GiB memory in use. Of the "
               "allocated memory 73.20 GiB is allocated by PyTorch, and 36.10 GiB is reserved by PyTorch but "
               "unallocated. If reserved but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
               "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    reason = ports._error_reason(torch.cuda.OutOfMemoryError(message))
    assert reason.startswith("out of memory: CUDA out of memory. Tried to allocate 36.00 GiB.")
    assert reason.endswith("36.10 GiB is reserved by PyTorch but unallocated.")
    assert ports._error_reason(ValueError("bad\nsecond line")) == "ValueError: bad"
