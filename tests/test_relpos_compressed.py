"""Transformer-XL relative positions (Enformer, Borzoi) inside the compressed kernel:
``kvbound.attention(q, ckv_k, ckv_v, relative_keys=...)`` against the float64 reference on the decompressed K/V,
through every loop the relative kernel runs (low-rank runs, general residual runs, masked tail; uniform runs are
never compiled with relative positions).
K/V are built in the storage format with chosen block modes (``test_kernels_residual.build``).
CPU: the kernel runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

import kvbound
from kvbound.attention import attention
from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd, block_runs
from kvbound.models.reference import relative_position_attention_reference
from test_attention import FLOOR  # tests/ is on sys.path (rootdir conftest)
from test_kernels_residual import L, P, R, W, build
from test_models_ports import borzoi, enformer  # noqa: F401 (the ports' fixtures; they skip when not installed)
from test_relpos import _port_style, relative_logits


def _relative_inputs(h, n, dk, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, dk, generator=g).to(dtype)
    relative_keys = (torch.randn(h, 2 * n - 1, dk, generator=g) * 0.5).to(dtype)
    u = torch.randn(1, h, 1, dk, generator=g) * 0.5
    w = torch.randn(1, h, 1, dk, generator=g) * 0.5
    return q, relative_keys, u, w


CASES = {
    # name: (K modes per head, V modes per head, n, dk, dv, shared basis, dtype, runs (low-rank, residual))
    "n1-packed-k": ([[P(4)]], [[L]], 1, 64, 192, True, torch.float16, [0, 1]),
    "n37-lowrank-only": ([[L, L, L]] * 2, [[L, L, L]] * 2, 37, 40, 48, True, torch.float32, None),
    "n37-mixed-fp32": ([[L, P(4), R]] * 2, [[P(4), L, W(6)]] * 2, 37, 40, 48, True, torch.float32, [0, 2]),
    "n37-per-block-basis": ([[P(4), L, W(5)]], [[L, R, P(4)]], 37, 64, 192, False, torch.float16, [0, 1]),
    "n130-all-kinds": (
        [[L, L, P(4), P(4), L, R, W(8), L, P(4)]],
        [[L, L, L, P(4), L, L, L, L, W(6)]],
        130,
        64,
        192,
        True,
        torch.float16,
        [3, 3],
    ),
    "n130-fp32-dk40": (
        [[P(4), L, L, L, L, L, R, L, L]] * 2,
        [[L, L, P(4), P(4), L, L, L, L, L]] * 2,
        130,
        40,
        48,
        True,
        torch.float32,
        [6, 6],
    ),
}


def _compressed_span(starts: list[int], rows: int) -> int:
    """The compressed kernel's ``RUN_SPAN`` for these runs (0: more per tile than it unrolls)."""
    from kvbound.kernels.attention_compressed import COMPRESSED_RUN_SPAN, RUNS_WINDOW
    from kvbound.kernels.attention_dense import relative_run_span

    return relative_run_span(starts, rows, RUNS_WINDOW, COMPRESSED_RUN_SPAN)


def _relative_runs(ck, cv) -> list[int]:
    """Runs of low-rank-only and of residual super-blocks over all heads, as the launcher builds them for a
    relative-position kernel (no uniform runs: every residual block takes the general loop)."""
    k_op, v_op = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
    _, counts = block_runs(k_op, v_op, max(ck.config.block_size, cv.config.block_size))
    return counts.sum(0).tolist()


@pytest.mark.parametrize("name", sorted(CASES))
def test_compressed_relative_matches_float64_reference(name):
    k_modes, v_modes, n, dk, dv, shared, dtype, kinds = CASES[name]
    ck = build(k_modes, n=n, d=dk, bits=4, block=16, dtype=dtype, shared=shared, seed=1)
    cv = build(v_modes, n=n, d=dv, bits=4, block=16, dtype=dtype, shared=shared, seed=2)
    if kinds is not None:
        assert _relative_runs(ck, cv) == kinds  # the loops this case is meant to reach
    h = len(k_modes)
    q, rk, u, w = _relative_inputs(h, n, dk, dtype, seed=n + dk)
    copies = [t.clone() for t in (q, rk, u, w, ck.coeffs, ck.codes, cv.coeffs, cv.codes)]
    scale = dk**-0.5
    out = attention(q, ck, cv, scale=scale, relative_keys=rk, relative_content_bias=u, relative_position_bias=w)
    k_ref, v_ref = ck.decompress(), cv.decompress()
    expected = relative_position_attention_reference(q, k_ref, v_ref, rk, u, w, scale=scale)
    plain = _port_style(q, k_ref.to(dtype), v_ref.to(dtype), rk, u, w, scale)
    err = (out.double() - expected).abs().max().item()
    plain_err = (plain.double() - expected).abs().max().item()
    print(f"compressed relpos {name}: max err {err:.2e}, port-style {dtype} on the decoded K/V {plain_err:.2e}")
    assert out.shape == (1, h, n, dv) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert err <= 2 * plain_err + FLOOR[dtype]
    for before, after in zip(copies, (q, rk, u, w, ck.coeffs, ck.codes, cv.coeffs, cv.codes), strict=True):
        assert torch.equal(before, after)


def test_compressed_relative_composes_with_bias_softcap_causal():
    """Relative logits + an additive bias + soft-cap + causal mask, against the formula in float64 with the
    relative logits materialised (kernel order: relative logits, bias, soft-cap, mask)."""
    n, dk, dv, h = 45, 40, 24, 2
    ck = build([[L, P(4), L]] * h, n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=3)
    cv = build([[R, L, P(4)]] * h, n=n, d=dv, bits=4, block=16, dtype=torch.float32, seed=4)
    q, rk, u, w = _relative_inputs(h, n, dk, torch.float32, seed=5)
    bias = torch.randn(n, n, generator=torch.Generator().manual_seed(6))
    scale = 0.3
    out = attention(
        q,
        ck,
        cv,
        scale=scale,
        causal=True,
        bias=bias,
        softcap=4.0,
        relative_keys=rk,
        relative_content_bias=u[0, :, 0],
        relative_position_bias=w,
    )
    k_ref, v_ref = ck.decompress().double(), cv.decompress().double()
    qs = q.double() * scale
    logits = (qs + u.double()) @ k_ref.transpose(-1, -2) + relative_logits(qs + w.double(), rk, n) + bias.double()
    logits = 4.0 * torch.tanh(logits / 4.0)
    logits = logits.masked_fill(torch.arange(n)[None, :] > torch.arange(n)[:, None], float("-inf"))
    expected = torch.softmax(logits, dim=-1) @ v_ref
    err = (out.double() - expected).abs().max().item()
    print(f"compressed relpos + bias + softcap + causal: max err {err:.2e}")
    assert err < 2e-5


def test_compressed_relative_traces_under_torch_compile():
    n, dk, dv = 19, 16, 24
    ck = build([[P(4), L]] * 2, n=n, d=dk, bits=4, block=16, dtype=torch.float16, seed=7)
    cv = build([[L, P(4)]] * 2, n=n, d=dv, bits=4, block=16, dtype=torch.float16, seed=8)
    q, rk, u, w = _relative_inputs(2, n, dk, torch.float16, seed=9)
    fn = torch.compile(
        lambda q, r, u, w: attention(q, ck, cv, relative_keys=r, relative_content_bias=u, relative_position_bias=w),
        backend="aot_eager",
        fullgraph=True,
    )
    out = fn(q, rk, u, w)
    expected = relative_position_attention_reference(q, ck.decompress(), cv.decompress(), rk, u, w, scale=dk**-0.5)
    err = (out.double() - expected).abs().max().item()
    print(f"compressed relpos under torch.compile: max err {err:.2e}")
    assert err < 2e-3


def test_compressed_relative_needs_one_query_head_per_kv_head():
    n, dk = 20, 16
    ck = build([[L, L]], n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=10)
    cv = build([[L, L]], n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=11)
    q, rk, u, w = _relative_inputs(2, n, dk, torch.float32, seed=12)
    with pytest.raises(ValueError, match="one query head per K/V head, got Hq=2, Hkv=1"):
        attention(q, ck, cv, relative_keys=rk)
    zeros = torch.zeros(2, dk)
    with pytest.raises(ValueError, match="relative: relative positions need one query head per K/V head"):
        attention_compressed_fwd(
            q,
            CompressedOperand.from_compressed(ck),
            CompressedOperand.from_compressed(cv),
            None,
            0.25,
            False,
            None,
            relative=(rk, zeros, zeros),
        )
    bad = rk.clone()
    bad[0, 1, 2] = float("inf")
    ck2 = build([[L, L]] * 2, n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=13)
    with pytest.raises(ValueError, match="relative_keys"):
        attention(q, ck2, ck2, relative_keys=bad)


# ------------------------------------------------------------------------------------ patched ports
@pytest.mark.parametrize("port_name", ["enformer", "borzoi"])
def test_compressed_ports_take_one_fused_call_per_layer_within_bound(port_name, request, monkeypatch):
    """compress=True on the kvbound backend: one relative-position call per layer over all queries on the
    compressed K/V, each layer's output within the certified bound of the float64 reference (as the eager
    compressed path in test_models_ports)."""
    import test_models_ports as ports
    from kvbound.models import attention_output_bound, linear_output_bound, patch
    from kvbound.models.reference import borzoi_attention_module_reference, enformer_attention_module_reference

    fixture = request.getfixturevalue(port_name)
    model, attention_cls = fixture[:2]
    x = ports._enformer_input(43) if port_name == "enformer" else fixture[2]
    reference = enformer_attention_module_reference if port_name == "enformer" else borzoi_attention_module_reference
    modules = ports._attention_modules(model, attention_cls)
    assert len(modules) == 2  # both layers of the fixture's model are checked
    with torch.no_grad():
        seen, hooks = ports._capture_inputs(modules)
        try:
            model(x)
        finally:
            for h in hooks:
                h.remove()
        handle = patch(model, ports.CONFIG, calibrate_on=x, backend="kvbound", query_chunk=16)
        try:
            calls = ports._count_relative_calls(monkeypatch)
            for i, module in enumerate(modules):
                inp = seen[i][0]
                out = module(inp)
                ref = reference(module, inp)
                b, h, n, _ = ref["q"].shape
                assert calls[i] == (n, True)
                effective = ref["q"] * module.scale + module.rel_content_bias.double()
                core = attention_output_bound(effective, ref["v"], tau_k=ports.CONFIG.tau, tau_v=ports.CONFIG.tau)
                bound = linear_output_bound(core.transpose(1, 2).reshape(b, n, -1), module.to_out.weight)
                err = (out.double() - ref["out"]).abs()
                print(f"{port_name} layer {i} fused compressed: max err {err.max():.2e}, bound max {bound.max():.2e}")
                assert (err <= bound + 1e-5 * (1 + ref["out"].abs())).all()
            assert len(calls) == len(modules)
        finally:
            handle.undo()


# ------------------------------------------------------------------------------------ runs of equal relative keys
def _spy_compressed_launches(monkeypatch) -> list[tuple[bool, bool]]:
    """``(relative keys given, runs given)`` of every compressed launch."""
    from kvbound.kernels import attention_compressed as module

    seen, launch = [], module.attention_compressed_fwd

    def spy(*args, relative=None, relative_runs=None, **kwargs):
        seen.append((relative is not None, relative_runs is not None))
        return launch(*args, relative=relative, relative_runs=relative_runs, **kwargs)

    monkeypatch.setattr(module, "attention_compressed_fwd", spy)
    return seen


@pytest.mark.parametrize(
    ("name", "starts"),
    [
        ("n37-mixed-fp32", [0, 20, 30, 36, 37, 40, 50]),  # a few runs per tile, one per sign near the diagonal
        ("n130-all-kinds", [0, 60, 100, 120, 125, 128, 129, 130, 131, 134, 140, 160, 200]),
        ("n130-fp32-dk40", list(range(0, 259, 40))),  # runs longer than a tile: most tiles within one run
        ("n37-per-block-basis", [0, 36, 37]),
        ("n37-lowrank-only", [0, 10, 30, 36, 37, 38, 44, 60]),  # no residual block: the residual-free kernel
    ],
)
def test_compressed_runs_match_the_relative_keys_and_float64(name, starts, monkeypatch):
    """Relative keys constant over runs of distances (``relative_runs``) with compressed K/V: the kernel writes the
    table of run logits and reads each tile's runs (no window product), through every loop the case reaches; the
    same logits as the relative keys, against float64 on the decoded K/V; one key per run gives the same output bit
    for bit; nothing is written into the inputs."""
    from test_relative_runs import _run_keys

    k_modes, v_modes, n, dk, dv, shared, dtype, _ = CASES[name]
    ck = build(k_modes, n=n, d=dk, bits=4, block=16, dtype=dtype, shared=shared, seed=1)
    cv = build(v_modes, n=n, d=dv, bits=4, block=16, dtype=dtype, shared=shared, seed=2)
    h = len(k_modes)
    q, _, u, w = _relative_inputs(h, n, dk, dtype, seed=n + dk)
    keys = _run_keys(h, 2 * n - 1, dk, starts, torch.Generator().manual_seed(n)).to(dtype)
    assert _compressed_span(starts, 2 * n - 1) > 0  # within what the compressed kernel unrolls
    copies = [t.clone() for t in (q, keys, u, w, ck.coeffs, ck.codes, cv.coeffs, cv.codes)]
    scale = dk**-0.5
    common = dict(scale=scale, relative_content_bias=u, relative_position_bias=w)
    launches = _spy_compressed_launches(monkeypatch)
    runs = attention(q, ck, cv, relative_keys=keys, relative_runs=starts, **common)
    per_run = attention(q, ck, cv, relative_keys=keys[:, starts], relative_runs=starts, **common)
    window = attention(q, ck, cv, relative_keys=keys, **common)
    assert launches == [(False, True), (False, True), (True, False)]
    k_ref, v_ref = ck.decompress(), cv.decompress()
    expected = relative_position_attention_reference(q, k_ref, v_ref, keys, u, w, scale=scale)
    plain = _port_style(q, k_ref.to(dtype), v_ref.to(dtype), keys, u, w, scale)
    err, err_window, err_plain = ((x.double() - expected).abs().max().item() for x in (runs, window, plain))
    print(f"compressed runs {name}: {len(starts)} runs, max err {err:.2e}, relative keys {err_window:.2e}, "
          f"port-style {err_plain:.2e}")  # fmt: skip
    assert runs.dtype == dtype and torch.isfinite(runs).all()
    assert err <= 2 * err_plain + FLOOR[dtype]
    assert torch.equal(per_run, runs)
    for before, after in zip(copies, (q, keys, u, w, ck.coeffs, ck.codes, cv.coeffs, cv.codes), strict=True):
        assert torch.equal(before, after)


def test_compressed_runs_in_the_split_launch_match_one_launch_and_float64(monkeypatch):
    """Relative keys over runs in the split launch (asked for: the default no longer splits with relative positions):
    both passes write their rows of the run table and read the same runs; the merged output is one launch's within
    the 2x criterion against float64."""
    from test_relative_runs import _run_keys
    from test_split_lowrank import _launches

    starts = [0, 60, 100, 120, 125, 128, 129, 130, 131, 134, 140, 160, 200]
    k_modes, v_modes, n, dk, dv, shared, dtype, _ = CASES["n130-all-kinds"]  # low-rank super-blocks and residual ones
    ck = build(k_modes, n=n, d=dk, bits=4, block=16, dtype=dtype, shared=shared, seed=1)
    cv = build(v_modes, n=n, d=dv, bits=4, block=16, dtype=dtype, shared=shared, seed=2)
    h = len(k_modes)
    q, _, u, w = _relative_inputs(h, n, dk, dtype, seed=n + dk)
    keys = _run_keys(h, 2 * n - 1, dk, starts, torch.Generator().manual_seed(n)).to(dtype)
    common = dict(scale=dk**-0.5, relative_content_bias=u, relative_position_bias=w)
    passes = _launches(monkeypatch)
    monkeypatch.delenv("KVBOUND_SPLIT_LOWRANK", raising=False)
    one = attention(q, ck, cv, relative_keys=keys, relative_runs=starts, **common)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    split = attention(q, ck, cv, relative_keys=keys, relative_runs=starts, **common)
    assert passes == [0, 1, 2]
    k_ref, v_ref = ck.decompress(), cv.decompress()
    expected = relative_position_attention_reference(q, k_ref, v_ref, keys, u, w, scale=common["scale"])
    plain = _port_style(q, k_ref.to(dtype), v_ref.to(dtype), keys, u, w, common["scale"])
    err, err_one, err_plain = ((x.double() - expected).abs().max().item() for x in (split, one, plain))
    assert err <= 2 * err_plain + FLOOR[dtype] and err_one <= 2 * err_plain + FLOOR[dtype]


def test_compressed_runs_beyond_the_unrolled_span_take_the_relative_keys(monkeypatch):
    """More than 16 runs within one tile's distances: compressed K/V take the relative keys (expanded from one key
    per run), with the same output as given the full keys."""
    from test_relative_runs import _run_keys

    n, dk, dv, h = 37, 40, 48, 2
    ck = build([[L, P(4), R]] * h, n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=3)
    cv = build([[P(4), L, W(6)]] * h, n=n, d=dv, bits=4, block=16, dtype=torch.float32, seed=4)
    q, _, u, w = _relative_inputs(h, n, dk, torch.float32, seed=7)
    starts = list(range(0, 2 * n - 1, 2))  # 37 runs, every tile spans more than 16 of them
    assert _compressed_span(starts, 2 * n - 1) == 0
    keys = _run_keys(h, 2 * n - 1, dk, starts, torch.Generator().manual_seed(8))
    common = dict(scale=0.2, relative_content_bias=u, relative_position_bias=w)
    launches = _spy_compressed_launches(monkeypatch)
    per_run = attention(q, ck, cv, relative_keys=keys[:, starts], relative_runs=starts, **common)
    full = attention(q, ck, cv, relative_keys=keys, **common)
    assert launches == [(True, False), (True, False)]
    assert torch.equal(per_run, full)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compressed_kernel_writes_the_run_table(dtype):
    """The compressed kernel's table of run logits (``run_table``) against the float64 formula, every entry (two
    batch items, more runs than one prologue step, a ragged last query tile), and its refusals: a table of the wrong
    shape, a pinned tile wider than the window the runs were counted over."""
    from kvbound.attention import _run_layout
    from kvbound.kernels.attention_compressed import RUNS_WINDOW

    n, dk, dv, h = 37, 40, 48, 2
    g = torch.Generator().manual_seed(5)
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    ck = kvbound.compress_kv(torch.randn(2, h, n, dk, generator=g).to(dtype), config)
    cv = kvbound.compress_kv(torch.randn(2, h, n, dv, generator=g).to(dtype), config)
    q = torch.randn(2, h, n, dk, generator=g).to(dtype)
    u, w = (torch.randn(1, h, 1, dk, generator=g) * 0.5 for _ in range(2))
    starts = list(range(0, 2 * n - 1, 2))[:36] + [72]  # 37 runs: two prologue steps of 32
    run_keys = (torch.randn(h, len(starts), dk, generator=torch.Generator().manual_seed(10)) * 0.5).to(dtype)
    span = _compressed_span(starts, 2 * n - 1)
    _, _, buffer, _ = _run_layout(torch.tensor(starts), 2 * n - 1, n, n, span, RUNS_WINDOW)
    table = torch.full((2, h, len(starts), n), float("nan"))
    runs = (run_keys, buffer, u[0, :, 0].float().contiguous(), w[0, :, 0].float().contiguous())
    k_op, v_op = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
    attention_compressed_fwd(q, k_op, v_op, None, dk**-0.5, False, None, relative_runs=runs, run_table=table)
    expected = torch.einsum("bhnd,hrd->bhrn", q.double() * dk**-0.5 + w.double()[:, :, :, :], run_keys.double())
    err = (table.double() - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), err
    with pytest.raises(ValueError, match=r"^run_table: expected a contiguous float32 tensor of shape \(2, 2, 37, 37\)"):
        attention_compressed_fwd(q, k_op, v_op, None, dk**-0.5, False, None, relative_runs=runs,
                                 run_table=table[..., :5])  # fmt: skip
    with pytest.raises(ValueError, match=r"^config: with relative_runs a tile spans at most 127 distances"):
        attention_compressed_fwd(q, k_op, v_op, None, dk**-0.5, False, None, relative_runs=runs,
                                 config=dict(BLOCK_M=128, BLOCK_N=16, num_warps=4, num_stages=1))  # fmt: skip


@pytest.mark.parametrize("wide", [False, True])
def test_each_kernel_counts_the_runs_over_its_own_window(wide, request):
    """The compressed kernel counts the runs over its own relative tiles' widest window (64 x 64: 127 distances) and
    unrolls up to 16; the dense kernel over its runs tiles' (64 x 64, or with ``KVBOUND_RUNS_WIDE=1`` 128 x 64: 191)
    and up to 16 (32). ``kvbound.attention`` gives each kernel its own span: at Borzoi's layout (N = 4096, 31 runs)
    16 and 16, or 16 and 24 (18 runs in 191 distances)."""
    if wide:
        request.getfixturevalue("wide_runs")
    from kvbound.attention import _relative_runs as counted_runs
    from kvbound.kernels import attention_compressed
    from kvbound.kernels.attention_dense import relative_window
    from kvbound.models.reference import borzoi_positional_features_reference
    from kvbound.models.relative import equal_row_runs

    assert attention_compressed.RUNS_WINDOW == max(m + n - 1 for m, n, _, _ in attention_compressed._RELATIVE_SHAPES)
    from kvbound.kernels import attention_dense

    assert attention_compressed.RUNS_WINDOW == 127 and relative_window() == (191 if wide else 127)
    assert attention_compressed.COMPRESSED_RUN_SPAN == 16 and attention_dense.MAX_RUN_SPAN == (32 if wide else 16)
    n = 4096
    starts = equal_row_runs(borzoi_positional_features_reference(n, 32).float())
    keys = torch.zeros(1, 2 * n - 1, 4)
    runs, dense_span, compressed_span = counted_runs(starts, keys, 2 * n - 1, torch.zeros(1, 1, n, 4))
    assert runs.tolist() == starts and len(starts) == 31
    assert (dense_span, compressed_span) == ((24 if wide else 16), 16)


@pytest.mark.parametrize("starts", [[0, 20, 30, 36, 37, 40, 50], list(range(0, 73, 2))])
def test_compressed_runs_are_checked_whatever_the_kernel_reads(starts):
    """Full relative keys with a row that differs from its run's first row raise with compressed K/V, whether the
    kernel reads the runs (a few per tile) or the keys (more than 16 per tile); the op refuses a span above what the
    compressed kernel unrolls, and reads the keys for a span of 0."""
    from test_relative_runs import _run_keys

    n, dk, dv, h = 37, 40, 48, 2
    ck = build([[L, P(4), R]] * h, n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=3)
    cv = build([[P(4), L, W(6)]] * h, n=n, d=dv, bits=4, block=16, dtype=torch.float32, seed=4)
    q, _, u, w = _relative_inputs(h, n, dk, torch.float32, seed=7)
    keys = _run_keys(h, 2 * n - 1, dk, starts, torch.Generator().manual_seed(8))
    common = dict(scale=0.2, relative_content_bias=u, relative_position_bias=w)
    bad = keys.clone()
    bad[:, 1] += 1.0  # row 1 differs from its run's first row (0)
    with pytest.raises(ValueError, match=r"^relative_runs: expected every row of relative_keys equal to its run"):
        attention(q, ck, cv, relative_keys=bad, relative_runs=starts, **common)
    span = _compressed_span(starts, 2 * n - 1)
    expected = attention(q, ck, cv, relative_keys=keys, **common)
    fields = ("coeffs", "basis", "mode", "scale", "bits", "offset", "codes", "raw")
    op_args = (
        q, *(getattr(ck, f) for f in fields), *(getattr(cv, f) for f in fields), None, 1, 0.2, False, None, 16, 16,
        True, True, 4, 4, keys[:, starts].contiguous(), u[0, :, 0].contiguous(), w[0, :, 0].contiguous(),
    )  # fmt: skip
    runs = torch.tensor(starts)
    for given in {span, 0}:  # the kernel's runs (when span > 0); the relative keys expanded from one per run
        out, _ = torch.ops.kvbound.attention_compressed(*op_args, relative_runs=runs, relative_run_span=given)
        assert (out - expected).abs().max().item() < 1e-5, given
    with pytest.raises(ValueError, match=r"^relative_run_span: expected 0 .* or at most 16, got 32"):
        torch.ops.kvbound.attention_compressed(*op_args, relative_runs=runs, relative_run_span=32)
