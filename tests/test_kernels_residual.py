"""Residual tiles of the compressed kernel: every decode path (packed at 2, 3, 4, 8 bits; promoted to 4, 5, 6,
8 bits; exact blocks), the uniform runs (compile-time width, no branch per tile) and the general runs, mixtures
within one head, ragged N, GQA, dk != dv. K/V are built directly in the storage format with chosen modes and
large residual terms (a wrong code or step moves the output far beyond the tolerance); every result is compared
with the float64 oracle on the decompressed K/V."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvbound import CompressionConfig
from kvbound.codec.eager import _pack, _unpack
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW, CompressedKV, words_per_row
from kvbound.kernels.attention_compressed import (
    CompressedOperand,
    _columns,
    _load_codes_bytes,
    _load_codes_uniform,
    attention_compressed_fwd,
    block_runs,
    byte_planes,
    uniform_width,
)
from test_attention import check_against_reference  # tests/ is on sys.path (rootdir conftest)


# --------------------------------------------------------------------------------------- uniform decoder
@triton.jit
def _uniform_probe(
    Codes, Out, ROWS, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP32: tl.constexpr
):
    offs_n = tl.arange(0, 16)
    codes = _load_codes_uniform(Codes, 0, 0, offs_n, offs_n < ROWS, WIDTH, HEAD_DIM, D_PAD, FP32)
    offs_d = tl.arange(0, D_PAD)
    tl.store(Out + (offs_n * D_PAD)[:, None] + offs_d[None, :], codes.to(tl.float32))


@pytest.mark.parametrize(
    "bits, d", [(1, 64), (2, 64), (3, 64), (4, 64), (5, 128), (6, 40), (7, 64), (8, 64), (4, 40), (2, 192), (8, 24)]
)
def test_uniform_decoder_matches_the_format(bits, d):
    """Element (n, d) of the uniform decoder is the format's code: word d // per_word, slot d % per_word; rows
    beyond the stored ones decode as if their words were zero (the kernel gives them step 0 or mask them)."""
    g = torch.Generator().manual_seed(bits * 1000 + d)
    rows = 11
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, d), generator=g)
    words = _pack(q, bits)
    assert words.shape == (rows, words_per_row(bits, d))
    d_pad = max(16, triton.next_power_of_2(d))
    for fp32 in (False, True):
        out = torch.full((16, d_pad), 12345.0, dtype=torch.float32)
        _uniform_probe[(1,)](words.reshape(-1).contiguous(), out, rows, WIDTH=bits, HEAD_DIM=d, D_PAD=d_pad, FP32=fp32)
        assert torch.equal(out[:rows, :d].long(), _unpack(words, bits, d))
        assert torch.equal(out[:rows, :d].long(), q)
        assert (out[rows:] == -(1 << (bits - 1))).all()


@triton.jit
def _bytes_probe(
    Codes,
    Out,
    Columns,
    WORD_OFFSET,
    ROWS,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP32: tl.constexpr,
):
    offs_n = tl.arange(0, 16)
    codes = _load_codes_bytes(Codes, WORD_OFFSET, 0, offs_n, offs_n < ROWS, WIDTH, HEAD_DIM, D_PAD, FP32)
    offs_d = tl.arange(0, D_PAD)
    tl.store(Out + (offs_n * D_PAD)[:, None] + offs_d[None, :], codes.to(tl.float32))
    tl.store(Columns + offs_d, _columns(HEAD_DIM, D_PAD, 8 // WIDTH))


@pytest.mark.parametrize("bits, d", [(2, 64), (4, 64), (8, 64), (4, 128), (2, 192), (4, 192), (4, 40), (8, 24)])
def test_byte_decoder_matches_the_format_in_plane_order(bits, d):
    """Operand column c of the byte decoder is the format's code of head dimension ``_columns(c)``, which is a
    permutation of 0..d-1 (plane order: column i * d/p + j is dimension j * p + i); the block may start at any
    16-byte boundary of the codes; rows beyond the stored ones decode as zero bytes."""
    g = torch.Generator().manual_seed(bits * 100 + d)
    rows = 11
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, d), generator=g)
    words = _pack(q, bits)
    assert byte_planes(bits, d) == 8 // bits
    d_pad = max(16, triton.next_power_of_2(d))
    lead = torch.randint(0, 1 << 30, (8,), generator=g, dtype=torch.int32)  # another block's words before it
    codes = torch.cat([lead, words.reshape(-1)]).contiguous()
    for fp32 in (False, True):
        out = torch.full((16, d_pad), 12345.0, dtype=torch.float32)
        columns = torch.full((d_pad,), -1, dtype=torch.int32)
        _bytes_probe[(1,)](codes, out, columns, 8, rows, WIDTH=bits, HEAD_DIM=d, D_PAD=d_pad, FP32=fp32)
        order = columns[:d].long()
        assert sorted(order.tolist()) == list(range(d))
        planes, plane = 8 // bits, d // (8 // bits)
        assert order.tolist() == [(c % plane) * planes + c // plane for c in range(d)]
        assert torch.equal(out[:rows, :d].long(), q[:, order])
        assert (out[rows:, :d] == -(1 << (bits - 1))).all()


def test_byte_planes_only_where_rows_fill_whole_words():
    assert [byte_planes(b, 64) for b in (1, 2, 3, 4, 5, 6, 7, 8)] == [0, 4, 0, 2, 0, 0, 0, 1]
    assert byte_planes(4, 40) == 2 and byte_planes(4, 36) == 0 and byte_planes(2, 40) == 0 and byte_planes(8, 4) == 1


def test_uniform_width_every_width_up_to_8_bits():
    assert [uniform_width(b, 64) for b in (1, 2, 3, 4, 5, 6, 7, 8)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert uniform_width(None, 64) == 0
    assert uniform_width(0, 64) == 0
    assert uniform_width(1, 8) == 1  # 32 codes per word, wider than the head: still one word per row
    assert uniform_width(16, 64) == 0  # wider than the float16 mantissa trick allows


# ------------------------------------------------------------------------------------- hand-built K/V
def build(
    modes: list[list[tuple[int, int]]],
    *,
    n: int,
    d: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
    shared: bool = True,
    rank: int = 8,
    seed: int = 0,
) -> CompressedKV:
    """A CompressedKV [1, H, n, d] whose block k of head h has ``modes[h][k] = (mode, width)``; codes, steps,
    factors and raw values are random, codes span their whole range and steps are large."""
    g = torch.Generator().manual_seed(seed)
    heads, nb = len(modes), -(-n // block)
    assert all(len(m) == nb for m in modes)
    coeffs = torch.randn(1, heads, n, rank, generator=g)
    if shared:
        basis = torch.randn(heads, rank, d, generator=g) / d**0.5
    else:
        basis = torch.randn(1, heads, nb, rank, d, generator=g) / d**0.5
    mode = torch.zeros(1, heads, nb, dtype=torch.int8)
    scale = torch.zeros(1, heads, nb, dtype=torch.float32)
    width = torch.zeros(1, heads, nb, dtype=torch.int8)
    offset = torch.full((1, heads, nb), -1, dtype=torch.int64)
    codes, raw = [], []
    words_so_far = raw_so_far = 0
    for h in range(heads):
        for k, (m, w) in enumerate(modes[h]):
            rows = min(n, (k + 1) * block) - k * block
            mode[0, h, k] = m
            if m in (MODE_PACKED, MODE_PROMOTED):
                assert (w == bits) == (m == MODE_PACKED)
                q = torch.randint(-(1 << (w - 1)), 1 << (w - 1), (rows, d), generator=g)
                scale[0, h, k] = 0.6 / (1 << (w - 1))
                width[0, h, k] = w
                offset[0, h, k] = words_so_far
                packed = _pack(q, w).reshape(-1)
                codes.append(packed)
                words_so_far += packed.numel()
            elif m == MODE_RAW:
                coeffs[0, h, k * block : k * block + rows] = 0.0
                offset[0, h, k] = raw_so_far
                values = (torch.randn(rows, d, generator=g) * 3).to(dtype).reshape(-1)
                raw.append(values)
                raw_so_far += values.numel()
    return CompressedKV(
        shape=(1, heads, n, d),
        dtype=dtype,
        config=CompressionConfig(block_size=block, rank=rank, bits=bits),
        coeffs=coeffs.to(torch.float16),
        basis=basis.to(torch.float16),
        mode=mode,
        scale=scale,
        bits=width,
        offset=offset,
        codes=torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int32),
        raw=torch.cat(raw) if raw else torch.zeros(0, dtype=dtype),
        shared_basis=shared,
    )


L = (MODE_LOWRANK, 0)
R = (MODE_RAW, 0)


def P(bits):  # noqa: N802 (a packed block at the configured width)
    return (MODE_PACKED, bits)


def W(bits):  # noqa: N802 (a promoted block)
    return (MODE_PROMOTED, bits)


def run(q, ck, cv, *, causal=False, uniform=True, scale=None):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, _ = attention_compressed_fwd(
        q,
        CompressedOperand.from_compressed(ck),
        CompressedOperand.from_compressed(cv),
        None,
        scale,
        causal,
        None,
        uniform=uniform,
    )
    check_against_reference(out, q, ck.decompress(), cv.decompress(), scale=scale, causal=causal)
    return out


def run_kinds(ck, cv) -> list[int]:
    """Number of runs of each kind (low-rank, uniform, general) over all heads, as the launcher builds them."""
    k_op, v_op = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
    fast = (uniform_width(ck.config.bits, ck.head_dim), uniform_width(cv.config.bits, cv.head_dim))
    # As the launcher: blocks read by the byte decode must start on a 16-byte boundary.
    align = (4 if byte_planes(fast[0], ck.head_dim) else 1, 4 if byte_planes(fast[1], cv.head_dim) else 1)
    super_block = max(ck.config.block_size, cv.config.block_size)
    _, counts = block_runs(k_op, v_op, super_block, fast, align)
    return counts.sum(0).tolist()


CASES = {
    # name: (K modes per head, V modes per head, K bits, V bits, n, dk, dv, block, Hq, dtype)
    "packed4-uniform-only": (
        [[P(4), L, P(4), P(4), P(4)]] * 2,
        [[P(4), P(4), L, P(4), P(4)]] * 2,
        4,
        4,
        150,
        64,
        64,
        32,
        4,
        torch.float16,
    ),
    "packed3-uniform-only-d128": (
        [[P(3), L, P(3), P(3)], [L, P(3), P(3), L]],
        [[P(3), P(3), P(3), L], [P(3), L, L, P(3)]],
        3,
        3,
        61,
        128,
        128,
        16,
        2,
        torch.float16,
    ),
    "packed8-2-uniform-only-dk128-dv192": (
        [[P(8), P(8), L, P(8)]],
        [[L, P(2), P(2), P(2)]],
        8,
        2,
        64,
        128,
        192,
        16,
        3,
        torch.float16,
    ),
    "packed2-and-promoted4": (
        [[P(2), W(4), L, P(2), P(2)], [L, P(2), P(2), W(8), P(2)]],
        [[P(2), P(2), P(2), L, W(5)], [P(2), L, W(6), P(2), P(2)]],
        2,
        2,
        150,
        64,
        64,
        32,
        4,
        torch.float16,
    ),
    "packed8-raw-fp32": (
        [[P(8), R, P(8), L, P(8), P(8)]],
        [[R, P(8), P(8), P(8), L, P(8)]],
        8,
        8,
        90,
        32,
        48,
        16,
        3,
        torch.float32,
    ),
    "packed3-promoted-general-only": (
        [[P(3), W(4), W(5), W(6), W(8)]],
        [[W(8), P(3), L, W(6), W(5)]],
        3,
        3,
        77,
        64,
        40,
        16,
        2,
        torch.float16,
    ),
    # Head 0's ragged last block (6 rows of 5 words) leaves head 1's blocks off the 16-byte boundary that the
    # byte decode needs: head 0 runs uniform, head 1 general, with the same widths.
    "packed4-dk40-ragged-unaligned-heads": (
        [[P(4)] * 5, [P(4)] * 5],
        [[L] * 5] * 2,
        4,
        4,
        70,
        40,
        32,
        16,
        2,
        torch.float16,
    ),
    "mixed-widths-k4-v2-dk40-dv192": (
        [[P(4), P(4), W(6), R, P(4)]],
        [[P(2), P(2), P(2), W(5), L]],
        4,
        2,
        70,
        40,
        192,
        16,
        4,
        torch.float16,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_residual_paths_match_reference(name):
    k_modes, v_modes, k_bits, v_bits, n, dk, dv, block, hq, dtype = CASES[name]
    ck = build(k_modes, n=n, d=dk, bits=k_bits, block=block, dtype=dtype, seed=1)
    cv = build(v_modes, n=n, d=dv, bits=v_bits, block=block, dtype=dtype, seed=2)
    q = (torch.randn(1, hq, 37, dk, generator=torch.Generator().manual_seed(3)) * 1.5).to(dtype)
    kinds = run_kinds(ck, cv)
    # Each case drives the loops it is named after.
    if "uniform-only" in name:
        assert kinds[1] > 0 and kinds[2] == 0
    elif "general-only" in name:
        assert kinds[1] == 0 and kinds[2] > 0
    else:
        assert kinds[1] > 0 and kinds[2] > 0, kinds
    run(q, ck, cv)


def test_uniform_and_general_loops_agree_causal_gqa():
    """The same data through uniform runs and through the general loop only (uniform=False): both within the
    tolerance of the oracle, causal, 4 query heads on 2 K/V heads, ragged N, K blocks of 32 and V blocks of 16."""
    k_modes = [[P(4), P(4), L, P(4), P(4)], [P(4), W(8), P(4), P(4), L]]
    v_modes = [[P(4), P(4), L, L, P(4), P(4), P(4), P(4), P(4), P(4)], [L] * 4 + [P(4)] * 6]
    ck = build(k_modes, n=150, d=64, bits=4, block=32, dtype=torch.float16, seed=4)
    cv = build(v_modes, n=150, d=32, bits=4, block=16, dtype=torch.float16, seed=5)
    q = torch.randn(1, 4, 150, 64, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    kinds = run_kinds(ck, cv)
    assert kinds[1] > 0 and kinds[2] > 0
    a = run(q, ck, cv, causal=True)
    b = run(q, ck, cv, causal=True, uniform=False)
    assert (a.float() - b.float()).abs().max().item() < 1e-2


def test_per_block_basis_uniform_runs_k_or_v_residual_only():
    """Per-block bases, residual in V only, then in K only (the other operand low-rank everywhere)."""
    lowrank = [[L] * 6]
    packed = [[P(4), P(4), L, P(4), P(4), P(4)]]
    q = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    for k_modes, v_modes in ((lowrank, packed), (packed, lowrank)):
        ck = build(k_modes, n=96, d=64, bits=4, block=16, dtype=torch.float16, shared=False, seed=8)
        cv = build(v_modes, n=96, d=64, bits=4, block=16, dtype=torch.float16, shared=False, seed=9)
        assert run_kinds(ck, cv)[1] > 0
        run(q, ck, cv)


def test_block_runs_three_kinds_match_a_python_scan():
    """Super-blocks classed as low-rank (0), uniform (1: every block low-rank or at the fast width) or general
    (2), and their runs, as a plain scan finds them; K blocks of 16 inside V super-blocks of 32."""
    g = torch.Generator().manual_seed(11)
    n, k_block, v_block = 16 * 300, 16, 32
    nb_k, nb_v = n // k_block, n // v_block
    mode_k = torch.randint(0, 4, (2, 2, nb_k), generator=g).to(torch.int8)
    mode_k[torch.rand(2, 2, nb_k, generator=g) < 0.6] = 0
    bits_k = torch.where(mode_k == 1, 4, torch.where(mode_k == 2, 8, 0)).to(torch.int8)
    bits_k[(mode_k == 2) & (torch.rand(2, 2, nb_k, generator=g) < 0.5)] = 4  # promoted at the fast width
    mode_v = (torch.rand(2, 2, nb_v, generator=g) < 0.4).to(torch.int8)
    bits_v = torch.where(mode_v == 1, 2, 0).to(torch.int8)
    # Word offsets: K blocks at a multiple of 4 words three times in four (the byte decode needs 16-byte starts).
    offset_k = torch.randint(0, 1000, (2, 2, nb_k), generator=g) * 4
    offset_k += (torch.rand(2, 2, nb_k, generator=g) < 0.25).long() * torch.randint(1, 4, (2, 2, nb_k), generator=g)
    offset_v = torch.randint(0, 4000, (2, 2, nb_v), generator=g)

    def operand(mode, bits, offset, block):
        return CompressedOperand(
            None, None, mode, None, bits, offset, None, None, seq_len=n, head_dim=8, block_size=block, shared_basis=True
        )

    runs, counts = block_runs(
        operand(mode_k, bits_k, offset_k, k_block), operand(mode_v, bits_v, offset_v, v_block), 32, (4, 2), (4, 1)
    )
    assert runs.shape == (4, 6, n // 32) and counts.shape == (4, 3)

    def klass(m, b, fast, aligned=True):
        return 0 if m == 0 else 1 if m in (1, 2) and b == fast and aligned else 2

    for row in range(4):
        bh = divmod(row, 2)
        flags = []
        for s in range(n // 32):
            ks = [
                klass(int(mode_k[bh][j]), int(bits_k[bh][j]), 4, int(offset_k[bh][j]) % 4 == 0)
                for j in (2 * s, 2 * s + 1)
            ]
            flags.append(max(ks + [klass(int(mode_v[bh][s]), int(bits_v[bh][s]), 2)]))
        for kind in range(3):
            want, start = [], None
            for i, f in enumerate(flags + [-1]):
                if f == kind and start is None:
                    start = i
                elif f != kind and start is not None:
                    want.append((start, i))
                    start = None
            count = int(counts[row, kind])
            got = list(zip(runs[row, 2 * kind, :count].tolist(), runs[row, 2 * kind + 1, :count].tolist(), strict=True))
            assert got == want, (row, kind)
        assert all(int(counts[row, kind]) > 0 for kind in range(3))


def test_uniform_runs_kept_off_the_tiles_and_loads_that_miscompile(monkeypatch):
    """On the GPU, uniform runs need coefficient tiles read by tensor descriptors and no 64-row tile on 8 warps
    (both miscompiled on sm_90 with Triton 3.6): the autotuner drops such tiles for uniform kernels only, and an
    explicit configuration of that shape turns uniform runs off."""
    from kvbound.kernels import attention_compressed as module

    configs = module.compressed_configs(False)
    base = dict(BLOCK_SIZE_K=128, BLOCK_SIZE_V=128, DV_PAD=128, K_RESIDUAL=True, V_RESIDUAL=True)
    general = [module._shape_of(c) for c in module._prune_compressed_configs(configs, {**base, "FAST_BITS_K": 0})]
    uniform = [module._shape_of(c) for c in module._prune_compressed_configs(configs, {**base, "FAST_BITS_K": 4})]
    assert (64, 64, 8, 3) in general
    assert uniform and not any(m == 64 and w == 8 for m, _, w, _ in uniform)
    assert set(uniform) < set(general)
    monkeypatch.setattr(module, "_KERNELS_INTERPRETED", False)
    assert module.uniform_safe(True, None)
    assert not module.uniform_safe(False, None)
    assert not module.uniform_safe(True, dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3))
    assert module.uniform_safe(True, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3))


def test_descriptor_layout_pads_narrow_coefficient_rows():
    """Rank-4 float16 coefficients (8-byte rows) become a view of a zero-padded copy with 16-byte rows: same
    values and shape, the input untouched; aligned ones come back as they are."""
    from kvbound.kernels.attention_compressed import descriptor_layout

    narrow = torch.randn(2, 3, 50, 4).to(torch.float16)
    before = narrow.clone()
    view = descriptor_layout(narrow)
    assert view.shape == narrow.shape and torch.equal(view, narrow) and torch.equal(narrow, before)
    assert all(stride * 2 % 16 == 0 for stride in view.stride()[:-1]) and view.stride(-1) == 1
    wide = torch.randn(2, 3, 50, 8).to(torch.float16)
    assert descriptor_layout(wide) is wide
    assert descriptor_layout(torch.randn(1, 1, 5, 3)).stride()[-2] == 4  # float32: 4 per 16 bytes


@pytest.mark.parametrize("seed", range(6))
def test_byte_decode_random_layouts_bias_softcap_causal(seed):
    """Random block layouts at a byte-decodable width (2, 4 or 8 bits) with promoted, raw and low-rank blocks
    mixed in, ragged N, GQA, causal or not, a broadcast bias and a soft-cap or not, through the launcher's
    default (uniform runs with the byte decode where they apply): the float64 oracle on the decoded K/V."""
    g = torch.Generator().manual_seed(100 + seed)
    bits = (2, 4, 8)[seed % 3]
    dk, dv = [(32, 32), (64, 48), (16, 64)][seed % 3]
    block, n = 16, int(torch.randint(40, 97, (1,), generator=g))
    heads, group = 1 + seed % 2, 1 + (seed // 2) % 2
    wider = [w for w in (4, 5, 6, 8) if w > bits]
    choices = [L, L] + [P(bits)] * 6 + [R] + [W(w) for w in wider]

    def modes(second):
        # Block 0 at the configured width and block 1 promoted or exact in every head, so that one call drives a
        # uniform run and a general one; the other blocks at random.
        rest = torch.randint(0, len(choices), (-(-n // block) - 2,), generator=g)
        return [[P(bits), second] + [choices[int(i)] for i in rest] for _ in range(heads)]

    ck = build(
        modes(W(wider[-1]) if wider else R), n=n, d=dk, bits=bits, block=block, dtype=torch.float16, seed=seed + 1
    )
    cv = build(modes(R), n=n, d=dv, bits=bits, block=block, dtype=torch.float16, seed=seed + 2)
    q = (torch.randn(1, heads * group, n - 3, dk, generator=g) * 1.5).to(torch.float16)
    kinds = run_kinds(ck, cv)
    assert kinds[1] > 0 and kinds[2] > 0, kinds  # the byte decode's runs and general ones in one call
    causal = seed % 2 == 1
    softcap = 3.0 if seed % 3 == 0 else None
    bias = torch.randn(1, 1, 1, n, generator=g) if seed % 2 == 0 else None
    scale = dk**-0.5
    out, _ = attention_compressed_fwd(
        q,
        CompressedOperand.from_compressed(ck),
        CompressedOperand.from_compressed(cv),
        None if bias is None else bias.expand(1, heads * group, n - 3, n),
        scale,
        causal,
        softcap,
    )
    check_against_reference(
        out, q, ck.decompress(), cv.decompress(), scale=scale, causal=causal, bias=bias, softcap=softcap
    )
