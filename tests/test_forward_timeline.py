"""benchmarks/forward_timeline.py: how a trace is read into busy, idle and per-category device time."""

import torch

from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)


def test_union_of_intervals():
    timeline = load("forward_timeline")
    assert timeline.union_ms([]) == 0.0
    # microseconds in, milliseconds out: [0, 2000) and [3000, 4000), the second interval inside the first
    assert timeline.union_ms([(3000, 4000), (0, 1000), (500, 2000), (100, 200)]) == 3.0
    assert timeline.union_ms([(0, 1000), (1000, 1500)]) == 1.5


def test_kernel_categories():
    timeline = load("forward_timeline")
    assert timeline.category("_attention_dense_fwd") == "attention kernel"
    assert timeline.category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "matmul"
    assert timeline.category("void cudnn::cnn::conv2d_grouped_direct_kernel<float>") == "convolution"
    assert timeline.category("Memcpy DtoH (Device -> Pageable)") == "copy / cast"
    assert timeline.category("something else") == "other"


def test_a_trace_without_device_work_reads_as_zeros():
    """A CPU-only trace (no device events, one mark): every time is 0, nothing raises, no kernel rows."""
    timeline = load("forward_timeline")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("kvbound.tower"):
            torch.ones(4).sum()
    rows = timeline.trace_rows(prof, "m", 1, "v", "abc1234")
    values = {r["name"]: r["ms"] for r in rows if r["row"] == "timeline"}
    assert values["busy_ms"] == values["tower_busy_ms"] == "0.000"
    assert values["syncs"] == "" and not [r for r in rows if r["row"] == "kernels"]


class _Event:
    def __init__(self, name: str, start_ns: int, end_ns: int) -> None:
        self._name, self._start, self._end = name, start_ns, end_ns

    def name(self) -> str:
        return self._name

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end


def test_module_rows_rank_kernels_and_sum_the_rest():
    """The kernels launched inside the attention modules by name, longest first, names cut to KERNEL_NAME_CHARS,
    calls counted; past ``top`` one ``other`` row holds the rest's calls and time."""
    timeline = load("forward_timeline")
    long_name = "nvjet_" + "x" * 200
    inside = [
        _Event("_attention_dense_fwd", 0, 2_000_000),
        _Event("_attention_dense_fwd", 5_000_000, 7_500_000),
        _Event(long_name, 2_000_000, 2_300_000),
        _Event("copy", 3_000_000, 3_100_000),
        _Event("norm", 4_000_000, 4_050_000),
    ]
    base = {"model": "m", "batch": 1, "variant": "v", "commit": "abc1234"}
    rows = timeline.module_kernel_rows(inside, base, top=2)
    assert [(r["name"], r["calls"], r["ms"]) for r in rows] == [
        ("_attention_dense_fwd", 2, "4.500"),
        (long_name[: timeline.KERNEL_NAME_CHARS], 1, "0.300"),
        ("other (2 kernels)", 2, "0.150"),
    ]
    assert all(r["row"] == "module" and r["model"] == "m" for r in rows)
    assert timeline.module_kernel_rows([], base) == []
