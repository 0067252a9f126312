"""Relative keys constant over runs of distances (Borzoi's step-function features): ``kvbound.attention(...,
relative_runs=...)`` reads one value per query and run instead of the relative keys. The same function as without
it, against the float64 reference; its checks; Borzoi's features give such runs.
CPU: the kernel runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import os

import pytest
import torch

from kvbound.attention import attention
from kvbound.kernels.attention_dense import relative_run_span, relative_window
from kvbound.models.reference import borzoi_positional_features_reference, relative_position_attention_reference
from kvbound.models.relative import equal_row_runs
from test_relpos import _port_style, composed_reference, relative_logits


def _run_keys(h: int, rows: int, dk: int, starts: list[int], g: torch.Generator) -> torch.Tensor:
    keys = torch.empty(h, rows, dk)
    for start, end in zip(starts, [*starts[1:], rows], strict=True):
        keys[:, start:end] = torch.randn(h, 1, dk, generator=g) * 0.5
    return keys


def _case(b, h, n_q, n_k, dk, dv, starts, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, dk, generator=g)
    k = torch.randn(b, h, n_k, dk, generator=g)
    v = torch.randn(b, h, n_k, dv, generator=g)
    keys = _run_keys(h, n_q + n_k - 1, dk, starts, g)
    u = torch.randn(h, dk, generator=g) * 0.5
    w = torch.randn(h, dk, generator=g) * 0.5
    return q, k, v, keys, u, w


@pytest.mark.parametrize(
    ("b", "h", "n", "dk", "dv", "dtype", "starts", "span"),
    [
        (1, 2, 80, 16, 24, torch.float32, [0, 30, 60, 75, 79, 80, 84, 100, 130], 16),  # runs shorter than a tile
        (2, 1, 37, 40, 48, torch.float16, [0, 36, 37], 4),  # one run per sign of the distance, and distance 0
        (1, 2, 130, 64, 192, torch.float16, [0], 2),  # a single run: every distance alike
        (1, 1, 50, 16, 16, torch.float32, list(range(99)), 0),  # every row its own run: the kernel's inner loop
    ],
)
def test_runs_match_the_relative_keys_and_float64(b, h, n, dk, dv, dtype, starts, span):
    assert relative_run_span(starts, 2 * n - 1) == span  # unrolled runs (span > 0) or the inner loop (0)
    q, k, v, keys, u, w = (t.to(dtype) if i < 4 else t for i, t in enumerate(_case(b, h, n, n, dk, dv, starts, n)))
    scale = dk**-0.5
    common = dict(scale=scale, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    runs = attention(q, k, v, relative_runs=starts, **common)
    window = attention(q, k, v, **common)
    expected = relative_position_attention_reference(
        q, k, v, keys, u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk), scale=scale
    )
    plain = _port_style(q, k, v, keys, u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk), scale)
    errors = [(x.double() - expected).abs().max().item() for x in (runs, window, plain)]
    print(f"runs {len(starts)}, N={n}, {dtype}: max err {errors[0]:.2e}, keys {errors[1]:.2e}, port {errors[2]:.2e}")
    assert runs.dtype == dtype and torch.isfinite(runs).all()
    assert errors[0] <= 2 * errors[2] + 1e-6


@pytest.mark.parametrize("unrolled", [True, False])
def test_runs_with_run_logits_far_beyond_the_exponent_range(unrolled):
    """Run logits of about +-400 (relative keys 60x larger): each row's first run enters the softmax as a shift of
    its maximum, so nothing overflows (``exp2`` of the unshifted logits would). Unrolled runs and the inner loop,
    against float64, output and log-sum-exp."""
    n, dk = 70, 16
    starts = [0, 20, 50, 69, 70, 90, 120] if unrolled else list(range(2 * n - 1))
    assert (relative_run_span(starts, 2 * n - 1) > 0) == unrolled  # unrolled runs, or the kernel's inner loop
    q, k, v, keys, u, w = _case(1, 2, n, n, dk, dk, starts, 21)
    keys = keys * 60.0
    common = dict(scale=dk**-0.5, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    out, lse = attention(q, k, v, relative_runs=starts, return_lse=True, **common)
    expected = relative_position_attention_reference(
        q, k, v, keys, u.reshape(1, 2, 1, dk), w.reshape(1, 2, 1, dk), scale=dk**-0.5
    )
    qs = q.double() * dk**-0.5
    logits = (qs + u.double()[None, :, None]) @ k.double().transpose(-1, -2)
    logits = logits + relative_logits(qs + w.double()[None, :, None], keys, n)
    assert logits.abs().max().item() > 200
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out.double() - expected).abs().max().item() < 1e-4
    assert (lse.double() - torch.logsumexp(logits, dim=-1)).abs().max().item() < 1e-3


def test_runs_compose_with_bias_softcap_causal_and_cross_lengths():
    n_q, n_k, dk, dv = 21, 45, 40, 24
    starts = [0, 10, 20, 21, 30, 64]
    q, k, v, keys, u, w = _case(1, 2, n_q, n_k, dk, dv, starts, 3)
    bias = torch.randn(n_q, n_k, generator=torch.Generator().manual_seed(4))
    out, lse = attention(
        q, k, v, scale=0.3, causal=True, bias=bias, softcap=4.0, relative_keys=keys, relative_content_bias=u,
        relative_position_bias=w, relative_runs=torch.tensor(starts), return_lse=True,
    )  # fmt: skip
    expected = composed_reference(q, k, v, keys, u[None, :, None], w[None, :, None], 0.3, bias, 4.0)
    err = (out.double() - expected).abs().max().item()
    print(f"runs + bias + softcap + causal, Nq={n_q} Nk={n_k}: max err {err:.2e}")
    assert err < 2e-5 and torch.isfinite(lse).all()


def test_runs_are_checked():
    n, dk = 24, 16
    starts = [0, 12, 23, 30]
    q, k, v, keys, u, w = _case(1, 2, n, n, dk, dk, starts, 5)
    common = dict(relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    bad = keys.clone()
    bad[1, 20, 3] += 0.25  # inside the run starting at row 12
    with pytest.raises(ValueError, match=r"^relative_runs: expected every row of relative_keys equal to its run's "):
        attention(q, k, v, relative_runs=starts, **{**common, "relative_keys": bad})
    for given in ([1, 12], [0, 12, 12], [0, 47], [], [0, 30, 12]):
        with pytest.raises(ValueError, match=r"^relative_runs: expected increasing first rows of runs"):
            attention(q, k, v, relative_runs=given, **common)
    with pytest.raises(TypeError, match=r"^relative_runs: expected a sequence of ints"):
        attention(q, k, v, relative_runs=[0, 1.5], **common)
    with pytest.raises(ValueError, match=r"^relative_runs: expected a 1-D integer tensor"):
        attention(q, k, v, relative_runs=torch.tensor([0.0, 12.0]), **common)
    with pytest.raises(ValueError, match=r"^relative_runs: given without relative_keys"):
        attention(q, k, v, relative_runs=starts)
    nan = keys.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^relative_keys: expected finite values"):
        attention(q, k, v, relative_runs=starts, **{**common, "relative_keys": nan})
    assert torch.equal(keys, _case(1, 2, n, n, dk, dk, starts, 5)[3])  # nothing written


def test_runs_checks_are_deferred_with_the_others_and_the_op_never_reads_out_of_range():
    import numpy as np

    import kvbound

    n, dk = 24, 16
    starts = [0, 10, 20, 30]
    q, k, v, keys, u, w = _case(1, 2, n, n, dk, dk, starts, 6)
    common = dict(relative_content_bias=u, relative_position_bias=w)
    expected = attention(q, k, v, relative_keys=keys, relative_runs=starts, **common)
    for given in (range(0, 40, 10), np.array(starts), [np.int64(x) for x in starts]):  # other integer sequences
        got = attention(q, k, v, relative_keys=keys, relative_runs=given, **common)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with kvbound.deferred_checks() as scope:
        attention(q, k, v, relative_keys=keys, relative_runs=starts, **common)
        assert len(scope) == 1  # queued with the NaN/Inf checks: no host read at the call
    bad = keys.clone()
    bad[0, 5, 0] += 1.0
    message = r"^relative_runs: expected every row .* differ \(kvbound.attention call 1 of 1"
    with pytest.raises(ValueError, match=message):
        with kvbound.deferred_checks():
            attention(q, k, v, relative_keys=bad, relative_runs=starts, **common)  # queued, not read here
    # the op itself, given a layout kvbound.attention would refuse: an error, never an out-of-range read
    rows = 2 * n - 1
    u32, w32 = u.float(), w.float()
    layout_message = rf"^relative_runs: expected increasing first rows of runs from 0, below {rows},"
    for layout in ([0, 60], [3, 10], [0, 10, 10]):
        with pytest.raises(ValueError, match=layout_message):
            torch.ops.kvbound.attention_dense(q, k, v, None, 1, dk**-0.5, False, None, keys, u32, w32,
                                              torch.tensor(layout))  # fmt: skip


@pytest.mark.parametrize("wide", [False, True])
def test_run_span_is_the_most_runs_any_tile_spans(wide, request):
    """``relative_run_span`` against a count over every window of the kernel's tile span, on random layouts, for the
    64-row tiles (127 distances, up to 16 runs unrolled as a power of two), the 128-row tiles of
    ``KVBOUND_RUNS_WIDE=1`` (191, up to 32; above 16 a multiple of 8) and the compressed kernel's count (its own
    window, up to 16); the op refuses a span below the layout's (the unrolled kernel would skip runs)."""
    from kvbound.kernels import attention_dense

    if wide:
        request.getfixturevalue("wide_runs")
    window, limit = relative_window(), attention_dense.MAX_RUN_SPAN
    assert (window, limit) == ((191, 32) if wide else (127, 16))
    g = torch.Generator().manual_seed(11)
    for _ in range(40):
        rows = int(torch.randint(1, 600, (1,), generator=g))
        count = int(torch.randint(1, min(rows, 40) + 1, (1,), generator=g))
        starts = sorted({0, *torch.randint(0, rows, (count,), generator=g).tolist()})
        run_of = torch.searchsorted(torch.tensor(starts), torch.arange(rows), right=True) - 1
        most = max(len(set(run_of[x : x + window].tolist())) for x in range(rows))
        # a power of two (at least 2) up to 16, a multiple of 8 above
        rounded = max(2, 1 << (most - 1).bit_length()) if most <= 16 else -(-most // 8) * 8
        expected = 0 if most > limit else rounded
        assert relative_run_span(starts, rows) == expected, (starts, rows, most)
        # the compressed kernel's count: over its own window, up to 16
        most = max(len(set(run_of[x : x + 127].tolist())) for x in range(rows))
        expected = 0 if most > 16 else max(2, 1 << (most - 1).bit_length())
        assert relative_run_span(starts, rows, 127, 16) == expected, (starts, rows, most)
    n, dk = 40, 16
    starts = list(range(0, 60, 4))  # 15 runs within one tile's span
    q, k, v, keys, u, w = _case(1, 1, n, n, dk, dk, starts, 8)
    assert relative_run_span(starts, 2 * n - 1) == 16
    with pytest.raises(ValueError, match=r"^relative_run_span: expected at least the most runs one tile spans, got 4 "):
        torch.ops.kvbound.attention_dense(q, k, v, None, 1, dk**-0.5, False, None, keys, u, w, torch.tensor(starts), 4)
    out = torch.ops.kvbound.attention_dense(q, k, v, None, 1, dk**-0.5, False, None, keys, u, w,
                                            torch.tensor(starts), 16)[0]  # fmt: skip
    torch.testing.assert_close(out, attention(q, k, v, scale=dk**-0.5, relative_keys=keys, relative_content_bias=u,
                                              relative_position_bias=w), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_run_layout_is_derived_once_per_tensor_and_changes_with_it():
    """The device layout of a runs tensor is derived once and reused while the tensor is unchanged; writing into
    the tensor derives it again, and a layout made bad in place is refused by the op, not read from a stale copy."""
    from kvbound.attention import _run_layout

    n, dk = 40, 16
    starts = [0, 10, 20, 30, 50]
    q, k, v, keys, u, w = _case(1, 2, n, n, dk, dk, starts, 9)
    runs = torch.tensor(starts)
    first = _run_layout(runs, 2 * n - 1, n, n, 0, relative_window())
    assert _run_layout(runs, 2 * n - 1, n, n, 0, relative_window()) is first
    assert _run_layout(runs.clone(), 2 * n - 1, n, n, 0, relative_window()) is not first
    args = (q, k, v, None, 1, dk**-0.5, False, None, keys, u.float(), w.float())
    expected = attention(q, k, v, scale=dk**-0.5, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    torch.testing.assert_close(torch.ops.kvbound.attention_dense(*args, runs)[0], expected, rtol=1e-5, atol=1e-5)
    runs[1] = 0  # no longer increasing
    again = _run_layout(runs, 2 * n - 1, n, n, 0, relative_window())
    assert again is not first and not torch.equal(again[2], first[2])
    with pytest.raises(ValueError, match=r"^relative_runs: expected increasing first rows of runs from 0"):
        torch.ops.kvbound.attention_dense(*args, runs)


@pytest.mark.parametrize("wide", [False, True])
def test_every_unrolled_run_is_used_and_a_wider_pinned_tile_is_refused(wide, request):
    """A layout whose every tile holds many runs: 16 runs within the 47 distances of Nq = 32, Nk = 16, so the one
    32 x 16 tile of the interpreter walks all 15 unrolled steps; dropping any run moves the output. The span is
    counted for the runs' widest tile (64 x 64: 127 distances; 128 x 64: 191 with ``KVBOUND_RUNS_WIDE=1``), and a
    pinned tile wider than that is refused rather than run with too small a span, as is a span the rounding never
    gives."""
    from kvbound.kernels import attention_dense
    from kvbound.kernels.attention_dense import attention_dense_fwd

    if wide:
        request.getfixturevalue("wide_runs")
    window = 191 if wide else 127
    assert relative_window() == max(m + n - 1 for m, n, _, _ in attention_dense._RUNS_SHAPES) == window
    n_q, n_k, dk = 32, 16, 16
    starts = list(range(0, 46, 3))  # 16 runs over the 47 distances
    q, k, v, keys, u, w = _case(1, 1, n_q, n_k, dk, dk, starts, 9)
    assert relative_run_span(starts, n_q + n_k - 1) == 16
    common = dict(scale=0.5, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    runs = attention(q, k, v, relative_runs=starts, **common)
    qs = q.double() * 0.5
    logits = (qs + u.double()[None, :, None]) @ k.double().transpose(-1, -2)
    logits = logits + relative_logits(qs + w.double()[None, :, None], keys, n_q)
    expected = torch.softmax(logits, dim=-1) @ v.double()
    assert (runs.double() - expected).abs().max().item() < 1e-5
    run_keys = torch.zeros(1, 16, dk)
    buffer = torch.zeros(16 + 1 + 15, dtype=torch.int32)
    wider = dict(BLOCK_M=128, BLOCK_N=128 if wide else 16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=rf"^config: with run_span a tile spans at most {window} distances"):
        attention_dense_fwd(q[:, :, :8], k[:, :, :8], v[:, :, :8], None, 0.5, False, None,
                            relative_runs=(run_keys, buffer, u.float(), w.float()), run_span=16,
                            config=wider)  # fmt: skip
    allowed = "2, 4, 8, 16, 24 or 32" if wide else "2, 4, 8 or 16"
    for span in (1, 12, 20, 24, 40) if not wide else (1, 12, 20, 40):
        with pytest.raises(ValueError, match=rf"^run_span: expected 0, {allowed}, got {span}$"):
            attention_dense_fwd(q, k, v, None, 0.5, False, None, relative_runs=(run_keys, buffer, u.float(), w.float()),
                                run_span=span)  # fmt: skip


def test_runs_wide_is_read_at_import():
    """``KVBOUND_RUNS_WIDE`` when the kernels are imported: unset or 0, the 64-row tiles over 127 distances and up to
    16 runs; 1 adds the 128-row tiles, 191 distances, up to 32; anything else raises, naming the variable."""
    import subprocess
    import sys

    code = ("from kvbound.kernels import attention_dense as a; "
            "print(a.relative_window(), a.MAX_RUN_SPAN, len(a._RUNS_SHAPES), len(a._RELATIVE_SHAPES))")  # fmt: skip
    for value, expected in (("", "127 16 3 3"), ("0", "127 16 3 3"), ("1", "191 32 6 3")):
        env = {**os.environ, "KVBOUND_RUNS_WIDE": value}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.split("\n")[-2] == expected, (value, done.stdout, done.stderr)
    env = {**os.environ, "KVBOUND_RUNS_WIDE": "yes"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "KVBOUND_RUNS_WIDE: expected 0 or 1, got 'yes'" in done.stderr


def test_borzoi_features_are_runs_of_distances():
    """Borzoi's positional features are step functions of |d|: 16 widths, two signs and distance 0 give at most 33
    runs (31 at N = 4096), and the relative keys projected from them inherit the runs."""
    for n in (32, 300):
        features = borzoi_positional_features_reference(n, 32)
        starts = equal_row_runs(features)
        assert len(starts) <= 33 and starts == sorted(set(starts))
        keys = (features.float() @ torch.randn(32, 8)).reshape(1, 2 * n - 1, 8)
        q = torch.randn(1, 1, n, 8)
        common = dict(relative_keys=keys, relative_position_bias=torch.randn(1, 8))
        runs = attention(q, q, q, relative_runs=starts, **common)
        assert (runs - attention(q, q, q, **common)).abs().max().item() < 1e-5


@pytest.mark.gpu
def test_gpu_runs_bf16_borzoi_shape():
    n, h, dk, dv = 4096, 8, 64, 192
    features = borzoi_positional_features_reference(n, 32)
    starts = equal_row_runs(features)
    g = torch.Generator().manual_seed(7)
    keys = (features.float() @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
    q, k = (torch.randn(1, h, n, dk, generator=g) for _ in range(2))
    v = torch.randn(1, h, n, dv, generator=g)
    u, w = (torch.randn(h, dk, generator=g) * 0.3 for _ in range(2))
    q, k, v, keys = (t.to(torch.bfloat16).cuda().contiguous() for t in (q, k, v, keys))
    common = dict(relative_keys=keys, relative_content_bias=u.cuda(), relative_position_bias=w.cuda())
    runs = attention(q, k, v, relative_runs=starts, **common)
    window = attention(q, k, v, **common)
    # float64 on the first 256 queries (every key)
    qs = q[:, :, :256].double() * dk**-0.5
    logits = (qs + u.double().cuda()[None, :, None]) @ k.double().transpose(-1, -2)
    logits = logits + relative_logits(qs + w.double().cuda()[None, :, None], keys, n)
    expected = torch.softmax(logits, dim=-1) @ v.double()
    err_runs, err_window = ((x[:, :, :256].double() - expected).abs().max().item() for x in (runs, window))
    print(f"Borzoi shape bf16, first 256 queries vs float64: runs {err_runs:.3e}, relative keys {err_window:.3e}")
    assert torch.isfinite(runs).all()
    assert err_runs <= 2 * err_window + 1e-6
    per_run = keys[:, starts].contiguous()  # one key per run: the same output, bit for bit
    torch.testing.assert_close(attention(q, k, v, relative_runs=starts, **{**common, "relative_keys": per_run}), runs,
                               rtol=0, atol=0)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["borzoi", "every third row"])
def test_gpu_run_table_bf16(layout):
    """The table of run logits the kernel writes on an H200 (bf16 q and run keys, N = 1000: a ragged last query
    tile; Borzoi's 29 runs and 667 runs, many prologue steps) against the float64 formula, every entry."""
    from kvbound.attention import _run_layout
    from kvbound.kernels.attention_dense import attention_dense_fwd

    n, h, dk, dv = 1000, 4, 64, 192
    g = torch.Generator().manual_seed(13)
    if layout == "borzoi":
        starts = equal_row_runs(borzoi_positional_features_reference(n, 32).float())
    else:
        starts = list(range(0, 2 * n - 1, 3))
    span = relative_run_span(starts, 2 * n - 1)
    base = torch.randn(2, n, h * dk, generator=g).to(torch.bfloat16).cuda()
    q = base.view(2, n, h, dk).transpose(1, 2)
    k = torch.randn(2, h, n, dk, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(2, h, n, dv, generator=g).to(torch.bfloat16).cuda()
    run_keys = (torch.randn(h, len(starts), dk, generator=g) * 0.3).to(torch.bfloat16).cuda()
    u, w = ((torch.randn(h, dk, generator=g) * 0.3).cuda() for _ in range(2))
    _, _, buffer, _ = _run_layout(torch.tensor(starts, device="cuda"), 2 * n - 1, n, n, span, relative_window())
    table = torch.full((2, h, len(starts), n), float("nan"), device="cuda")
    attention_dense_fwd(q, k, v, None, dk**-0.5, False, None, relative_runs=(run_keys, buffer, u, w), run_span=span,
                        run_table=table)  # fmt: skip
    expected = torch.einsum("bhnd,hrd->bhrn", q.double() * dk**-0.5 + w.double()[None, :, None, :], run_keys.double())
    err = (table.double() - expected).abs().max().item()
    print(f"{layout}: {len(starts)} runs, run table vs float64 {err:.2e} (largest {expected.abs().max().item():.2f})")
    assert err <= 1e-5 * expected.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "causal"), [("borzoi", False), ("borzoi", True), ("every third row", False)])
def test_gpu_runs_bf16_ragged_causal_and_inner_loop(layout, causal):
    """N = 1000 (not a multiple of the 64-key tile: the last tile is ragged and the one-tile-ahead read of run
    indices runs past the keys), causal, and a layout of more than 16 runs per tile (the kernel's inner loop,
    RUN_SPAN 0), against float64 on the last 128 queries (the ragged row tile) and the first 128."""
    n, h, dk, dv = 1000, 4, 64, 192
    g = torch.Generator().manual_seed(12)
    if layout == "borzoi":
        features = borzoi_positional_features_reference(n, 32).float()
        starts = equal_row_runs(features)
        keys = (features @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
        # 16 runs in the 64-row tiles' 127 distances, 18 in the 128-row tiles' 191 (KVBOUND_RUNS_WIDE=1)
        assert relative_run_span(starts, 2 * n - 1) == (24 if relative_window() > 127 else 16)
    else:
        starts = list(range(0, 2 * n - 1, 3))
        keys = _run_keys(h, 2 * n - 1, dk, starts, g)
        assert relative_run_span(starts, 2 * n - 1) == 0
    q, k = (torch.randn(1, h, n, dk, generator=g) for _ in range(2))
    v = torch.randn(1, h, n, dv, generator=g)
    u, w = (torch.randn(h, dk, generator=g) * 0.3 for _ in range(2))
    q, k, v, keys = (t.to(torch.bfloat16).cuda().contiguous() for t in (q, k, v, keys))
    common = dict(relative_keys=keys, relative_content_bias=u.cuda(), relative_position_bias=w.cuda(), causal=causal)
    runs = attention(q, k, v, relative_runs=starts, **common)
    window = attention(q, k, v, **common)
    qs = q.double() * dk**-0.5
    logits = (qs + u.double().cuda()[None, :, None]) @ k.double().transpose(-1, -2)
    logits = logits + relative_logits(qs + w.double().cuda()[None, :, None], keys, n)
    if causal:
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    expected = torch.softmax(logits, dim=-1) @ v.double()
    rows = torch.cat([torch.arange(128), torch.arange(n - 128, n)]).cuda()
    err_runs, err_window = ((x[:, :, rows].double() - expected[:, :, rows]).abs().max().item() for x in (runs, window))
    print(f"{layout}, causal={causal}, N={n} bf16 vs float64: runs {err_runs:.3e}, relative keys {err_window:.3e}")
    assert torch.isfinite(runs).all()
    assert err_runs <= 2 * err_window + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_runs_bf16_every_tile_shape(causal, wide_runs):
    """Each tile shape of the runs' variant pinned (64- and 128-row tiles, as ``KVBOUND_RUNS_WIDE=1`` searches them)
    at Borzoi's layout, N = 1000 (ragged last tiles), 18 runs in the widest tile's 191 distances (RUN_SPAN 24),
    against float64 on the first and last 128 queries: within twice the relative keys' error."""
    from kvbound.attention import _run_layout
    from kvbound.kernels.attention_dense import _RUNS_SHAPES, attention_dense_fwd

    n, h, dk, dv = 1000, 4, 64, 192
    g = torch.Generator().manual_seed(14)
    features = borzoi_positional_features_reference(n, 32).float()
    starts = equal_row_runs(features)
    keys = (features @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
    span = relative_run_span(starts, 2 * n - 1)
    assert span == 24
    q, k = (torch.randn(1, h, n, dk, generator=g) for _ in range(2))
    v = torch.randn(1, h, n, dv, generator=g)
    u, w = (torch.randn(h, dk, generator=g) * 0.3 for _ in range(2))
    q, k, v, keys = (t.to(torch.bfloat16).cuda().contiguous() for t in (q, k, v, keys))
    u, w = u.cuda(), w.cuda()
    window = attention(q, k, v, relative_keys=keys, relative_content_bias=u, relative_position_bias=w, causal=causal)
    qs = q.double() * dk**-0.5
    logits = (qs + u.double()[None, :, None]) @ k.double().transpose(-1, -2)
    logits = logits + relative_logits(qs + w.double()[None, :, None], keys, n)
    if causal:
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    expected = torch.softmax(logits, dim=-1) @ v.double()
    rows = torch.cat([torch.arange(128), torch.arange(n - 128, n)]).cuda()
    err_window = (window[:, :, rows].double() - expected[:, :, rows]).abs().max().item()
    _, _, buffer, _ = _run_layout(torch.tensor(starts, device="cuda"), 2 * n - 1, n, n, span, relative_window())
    run_keys = keys[:, starts].contiguous()
    assert len(_RUNS_SHAPES) == 6
    for m, n_, warps, stages in sorted(_RUNS_SHAPES):
        config = {"BLOCK_M": m, "BLOCK_N": n_, "num_warps": warps, "num_stages": stages}
        out, _ = attention_dense_fwd(q, k, v, None, dk**-0.5, causal, None, config=config,
                                     relative_runs=(run_keys, buffer, u, w), run_span=span)  # fmt: skip
        err = (out[:, :, rows].double() - expected[:, :, rows]).abs().max().item()
        print(f"runs {m}x{n_}x{warps}x{stages}, causal={causal}: {err:.3e} (relative keys {err_window:.3e})")
        assert torch.isfinite(out).all() and err <= 2 * err_window + 1e-6, (config, err, err_window)


def test_runs_on_128_row_tiles_match_float64(wide_runs):
    """A 128 x 64 tile pinned in the interpreter (the widest of ``KVBOUND_RUNS_WIDE=1``, 191 distances): 18 runs
    within its window, so RUN_SPAN 24 walks unrolled steps past 16; ragged query and key tiles (Nq = 150, Nk = 100),
    causal and not, against float64."""
    from kvbound.attention import _run_layout
    from kvbound.kernels.attention_dense import attention_dense_fwd

    n_q, n_k, dk, dv = 150, 100, 16, 24
    rows = n_q + n_k - 1
    starts = [0, 60, 100, 120, *range(130, 160, 3), 170, 185, 200, 230]  # 18 runs between 120 and 310 < 249 rows
    starts = [s for s in starts if s < rows]
    span = relative_run_span(starts, rows)
    assert span == 24
    q, k, v, keys, u, w = _case(1, 2, n_q, n_k, dk, dv, starts, 31)
    _, _, buffer, _ = _run_layout(torch.tensor(starts), rows, n_q, n_k, span, relative_window())
    config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    for causal in (False, True):
        out, _ = attention_dense_fwd(q, k, v, None, 0.25, causal, None, config=config,
                                     relative_runs=(keys[:, starts].contiguous(), buffer, u, w),
                                     run_span=span)  # fmt: skip
        qs = q.double() * 0.25
        logits = (qs + u.double()[None, :, None]) @ k.double().transpose(-1, -2)
        logits = logits + relative_logits(qs + w.double()[None, :, None], keys, n_q)
        if causal:
            logits = logits.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.softmax(logits, dim=-1) @ v.double()
        err = (out.double() - expected).abs().max().item()
        assert err < 1e-5, (causal, err)


def test_keys_one_row_per_run_give_the_full_keys_result():
    """``relative_keys`` given one row per run (``[H, len(relative_runs), Dk]``) gives exactly the output of the
    full keys those rows stand for, on dense and compressed K/V, through ``relative_position_attention``'s fused
    and chunked paths; ``expand_run_keys`` rebuilds the full keys; the per-run keys are not written."""
    import kvbound
    from kvbound.attention import expand_run_keys
    from kvbound.models.relative import relative_position_attention

    n, dk, dv, h = 80, 16, 24, 2
    starts = [0, 30, 60, 75, 79, 80, 84, 100, 130]
    q, k, v, keys, u, w = _case(1, h, n, n, dk, dv, starts, 21)
    per_run = keys[:, starts].clone()
    assert torch.equal(expand_run_keys(per_run, starts, 2 * n - 1), keys)
    assert torch.equal(expand_run_keys(per_run, torch.tensor(starts), 2 * n - 1), keys)
    before = per_run.clone()
    common = dict(scale=dk**-0.5, relative_content_bias=u, relative_position_bias=w, relative_runs=starts)
    full = attention(q, k, v, relative_keys=keys, **common)
    torch.testing.assert_close(attention(q, k, v, relative_keys=per_run, **common), full, rtol=0, atol=0)
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    ck, cv = kvbound.compress_kv(k, config), kvbound.compress_kv(v, config)
    torch.testing.assert_close(
        attention(q, ck, cv, relative_keys=per_run, **common), attention(q, ck, cv, relative_keys=keys, **common),
        rtol=0, atol=0,
    )  # fmt: skip
    uu, ww = u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk)
    for backend in ("kvbound", "eager"):
        got = relative_position_attention(q, k, v, per_run, uu, ww, scale=dk**-0.5, backend=backend,
                                          relative_runs=starts)  # fmt: skip
        expected = relative_position_attention(q, k, v, keys, uu, ww, scale=dk**-0.5, backend=backend)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(per_run, before)


def test_keys_one_row_per_run_are_checked():
    n, dk = 24, 16
    starts = [0, 12, 23, 30]
    q, k, v, keys, u, w = _case(1, 2, n, n, dk, dk, starts, 22)
    per_run = keys[:, starts].clone()
    common = dict(relative_content_bias=u, relative_position_bias=w)
    with pytest.raises(ValueError, match=r"^relative_keys: expected shape .* or, one row per run, .* = \[2, 4, 16\]"):
        attention(q, k, v, relative_keys=per_run[:, :3], relative_runs=starts, **common)
    full_only = r"^relative_keys: expected shape \[Hq, Nq \+ Nk - 1, Dk\] = \[2, 47, 16\], got"
    with pytest.raises(ValueError, match=full_only):
        attention(q, k, v, relative_keys=per_run, **common)  # without runs only the full keys
    nan = per_run.clone()
    nan[1, 2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"^relative_keys: expected finite values"):
        attention(q, k, v, relative_keys=nan, relative_runs=starts, **common)
    # the op itself, given keys of neither length: an error, never an out-of-range read
    u32, w32 = u.float(), w.float()
    neither = r"^relative_keys: expected Nq \+ Nk - 1 = 47 rows or one per run \(4\), got 3"
    with pytest.raises(ValueError, match=neither):
        torch.ops.kvbound.attention_dense(q, k, v, None, 1, dk**-0.5, False, None, per_run[:, :3], u32, w32,
                                          torch.tensor(starts))  # fmt: skip


def test_expanding_keys_one_row_per_run_checks_the_runs():
    from kvbound.attention import expand_run_keys
    from kvbound.models.relative import relative_position_attention

    keys = torch.randn(2, 3, 4)
    torch.testing.assert_close(expand_run_keys(keys, [0, 2, 3], 5)[:, :, 0], keys[:, [0, 0, 1, 2, 2], 0])
    for starts in ([1, 2, 3], [0, 3, 2], [0, 2, 5], [], torch.tensor([0, 2, 2]), torch.tensor([1, 2, 3])):
        with pytest.raises(ValueError, match=r"^relative_runs: expected increasing first rows of runs from 0"):
            expand_run_keys(keys, starts, 5)
    with pytest.raises(ValueError, match=r"^relative_keys: expected one row per run \(2\), got 3"):
        expand_run_keys(keys, [0, 2], 5)
    q = torch.randn(1, 2, 3, 4)  # the chunked path checks the runs it expands
    with pytest.raises(ValueError, match=r"^relative_runs: expected increasing first rows"):
        relative_position_attention(q, q, q, keys, torch.zeros(2, 4), torch.zeros(2, 4), scale=0.5, backend="eager",
                                    relative_runs=[0, 4, 2])  # fmt: skip
    with pytest.raises(ValueError, match=r"^relative_runs: expected increasing first rows"):
        relative_position_attention(q, q, q, keys, torch.zeros(2, 4), torch.zeros(2, 4), scale=0.5, backend="eager",
                                    relative_runs=torch.tensor([0, 2, 2]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads_split", [True, False])
def test_kernel_writes_the_run_table_in_float32_under_autocast(dtype, heads_split):
    """The table of run logits that each program of the dense kernel writes for its queries (``run_table``,
    runs-major ``[B, H, R, Nq]``) against the float64 formula ``scale (q . R[run]) + w . R[run]``: every entry,
    float32 and exact to float32 rounding, under bfloat16 autocast (which the kernel does not see), for a
    heads-split query view as the patched layers pass it, a length that is not a multiple of the query tile (its
    padding rows are not written) and more runs than one step of the kernel's prologue (40 > 32); the output is
    the output of the relative keys."""
    from kvbound.kernels.attention_dense import attention_dense_fwd

    g = torch.Generator().manual_seed(5)
    b, h, n, d, runs = 2, 3, 41, 16, 40
    starts = list(range(0, 2 * runs, 2))  # 40 runs of two distances over the 81 distances
    base = torch.randn(b, n, h * d, generator=g).to(dtype)
    q = base.view(b, n, h, d).transpose(1, 2)
    if not heads_split:
        q = q.contiguous()
    k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(2))
    keys = _run_keys(h, 2 * n - 1, d, starts, g).to(dtype)
    u, w = (torch.randn(h, d, generator=g) for _ in range(2))
    scale = 0.125
    run_keys = keys[:, starts].contiguous()
    expected = torch.einsum("bhnd,hrd->bhrn", q.double() * scale + w.double()[None, :, None, :], run_keys.double())
    from kvbound.attention import _run_layout

    span = relative_run_span(starts, 2 * n - 1)
    _, _, buffer, _ = _run_layout(torch.tensor(starts), 2 * n - 1, n, n, span, relative_window())
    table = torch.full((b, h, runs, n), float("nan"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_dense_fwd(q, k, v, None, scale, False, None, relative_runs=(run_keys, buffer, u, w),
                                     run_span=relative_run_span(starts, 2 * n - 1), run_table=table)  # fmt: skip
    err = (table.double() - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), err
    common = dict(scale=scale, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    assert (out.float() - attention(q, k, v, **common).float()).abs().max().item() < 5e-3
    with pytest.raises(ValueError, match=r"^run_table: expected a contiguous float32 tensor of shape \(2, 3, 40, 41\)"):
        attention_dense_fwd(q, k, v, None, scale, False, None, relative_runs=(run_keys, buffer, u, w),
                            run_table=table[:, :, :, :40])  # fmt: skip


@pytest.mark.parametrize(("q_scratch", "runs_add"), [("1", "0"), ("0", "1"), ("1", "1"), ("auto", "0"), ("0", "0")])
def test_kernel_switches_give_the_same_function(q_scratch, runs_add):
    """KVBOUND_Q_SCRATCH (query forms through the output rows) and KVBOUND_RUNS_ADD (runs added after a zero
    product) select kernel code once per process: each setting, in a fresh interpreter process, gives the runs and
    the relative keys within twice the port-style error against float64 (the defaults run in every other test)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import torch
from kvbound.attention import attention
from kvbound.models.reference import relative_position_attention_reference
from test_relative_runs import _case
from test_relpos import _port_style
h, n, dk, dv, starts = 2, 80, 16, 24, [0, 30, 60, 75, 79, 80, 84, 100, 130]
q, k, v, keys, u, w = (t.half() if i < 4 else t for i, t in enumerate(_case(1, h, n, n, dk, dv, starts, 3)))
common = dict(scale=dk**-0.5, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
ub, wb = u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk)
expected = relative_position_attention_reference(q, k, v, keys, ub, wb, scale=dk**-0.5)
port = (_port_style(q, k, v, keys, ub, wb, dk**-0.5).double() - expected).abs().max().item()
for out in (attention(q, k, v, relative_runs=starts, **common), attention(q, k, v, **common)):
    err = (out.double() - expected).abs().max().item()
    print(f"err {err:.2e} port {port:.2e}")
    assert err <= 2 * port + 1e-6, (err, port)
"""
    here = Path(__file__).parent
    env = dict(os.environ, KVBOUND_Q_SCRATCH=q_scratch, KVBOUND_RUNS_ADD=runs_add, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(here), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("err ") == 2


def test_kernel_switch_values_are_checked():
    import os
    import subprocess
    import sys

    env = dict(os.environ, KVBOUND_RUNS_ADD="sometimes", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", "import kvbound.kernels.attention_dense"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and "KVBOUND_RUNS_ADD: expected one of 1, 0" in done.stderr
