"""Stand-alone check of the compact code decode that kvbound's uniform residual loop used (no kvbound import).

An attention-shaped loop over key tiles: each tile's K and V codes are loaded as one ``[BLOCK_N, words]`` int32
tile (``32 // WIDTH`` codes per word), expanded in registers by ``tl.join``/``tl.reshape`` to ``[BLOCK_N, D]``,
turned into exact float16 operands, and consumed as ``softmax(q codes_k^T) codes_v`` with an online softmax. On an
H200 with Triton 3.6 this construction inside kvbound's kernel gave NaN, wrong values or illegal addresses at
d = 128 depending on the tile (src/kvbound/kernels/README.md); this script asks whether the construction alone
does, one tile configuration per process so that a fault cannot poison the next::

    python benchmarks/repro_compact_decode.py                 # GPU: every configuration, one line each
    python benchmarks/repro_compact_decode.py --decode bytes  # the byte tiles in plane order kvbound reads now
    TRITON_INTERPRET=1 python benchmarks/repro_compact_decode.py --cpu   # the same checks in the interpreter

With ``--decode bytes`` the loop reads the codes as kvbound's uniform loop now does (one contiguous byte run per
plane, queries and output in plane order), which inside kvbound miscompiled on 64-row tiles over 8 warps at
d >= 128 (``benchmarks/byte_decode_tiles.py``): the same question for that decode.

Exit status 1 when any configuration is wrong or crashes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import triton
import triton.language as tl

CONFIGS = [  # (head dim, width, BLOCK_M, BLOCK_N, warps, stages)
    (d, w, m, n, warps, stages)
    for d in (64, 128)
    for w in (4, 8)
    for m, n, warps, stages in ((64, 64, 4, 3), (64, 64, 8, 3), (64, 64, 8, 2), (128, 64, 8, 3), (64, 64, 8, 1))
]
CPU_CONFIGS = [(32, 4, 16, 16, 4, 1), (64, 8, 16, 16, 4, 1), (128, 4, 32, 16, 4, 1)]


@triton.jit
def _expand(words, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, WIDTH: tl.constexpr):
    unsigned = words
    for level in tl.static_range(0, 5):
        if (32 >> level) > WIDTH:
            half = (32 >> level) // 2
            low = unsigned & ((1 << half) - 1)
            high = (unsigned >> half) & ((1 << half) - 1)
            unsigned = tl.reshape(tl.join(low, high), [BLOCK_N, WORDS * (2 << level)])
    magic = (unsigned | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return (magic - (1024.0 + (1 << (WIDTH - 1)))).to(tl.float16)


@triton.jit
def _online_softmax_step(q, codes_k, codes_v, m_i, l_i, acc):
    """One key tile of softmax(q codes_k^T / 100) codes_v with a running maximum."""
    s = tl.dot(q, tl.trans(codes_k)) * 0.01
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), codes_v)
    return m_new, l_i, acc


@triton.jit
def _kernel(Q, KW, VW, Out, N, D: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    WORDS: tl.constexpr = D * WIDTH // 32
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    q = tl.load(Q + head * N * D + rows[:, None] * D + cols[None, :], mask=(rows < N)[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_w = tl.arange(0, WORDS)
    for start in range(0, N, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        word_ptrs = head * N * WORDS + keys[:, None] * WORDS + offs_w[None, :]
        codes_k = _expand(tl.load(KW + word_ptrs), BLOCK_N, WORDS, WIDTH)
        codes_v = _expand(tl.load(VW + word_ptrs), BLOCK_N, WORDS, WIDTH)
        m_i, l_i, acc = _online_softmax_step(q, codes_k, codes_v, m_i, l_i, acc)
    out = acc / l_i[:, None]
    tl.store(Out + head * N * D + rows[:, None] * D + cols[None, :], out, mask=(rows < N)[:, None])


@triton.jit
def _plane_columns(D: tl.constexpr, WIDTH: tl.constexpr):
    """Plane order: column c = i * (D / p) + j holds head dimension j * p + i (p = 8 / WIDTH codes per byte)."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    PLANE: tl.constexpr = D // PER_BYTE
    c = tl.arange(0, D)
    return (c % PLANE) * PER_BYTE + c // PLANE, c % PLANE, (c // PLANE) * WIDTH


@triton.jit
def _bytes(KB, base, keys, D: tl.constexpr, WIDTH: tl.constexpr):
    """A [BLOCK_N, D] code tile in plane order from the rows' bytes: one contiguous run of bytes per plane."""
    ROW_BYTES: tl.constexpr = D * WIDTH // 8
    _, byte_column, shift = _plane_columns(D, WIDTH)
    raw = tl.load(KB + base + keys[:, None] * ROW_BYTES + byte_column[None, :])
    unsigned = (raw.to(tl.int32) >> shift[None, :]) & ((1 << WIDTH) - 1)
    magic = (unsigned | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return (magic - (1024.0 + (1 << (WIDTH - 1)))).to(tl.float16)


@triton.jit
def _kernel_bytes(
    Q, KW, VW, Out, N, D: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The same attention loop over codes decoded by ``_bytes`` (the layout kvbound's uniform loop reads now):
    queries and the output in plane order, no reshape anywhere."""
    ROW_BYTES: tl.constexpr = D * WIDTH // 8
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, _, _ = _plane_columns(D, WIDTH)
    q = tl.load(Q + head * N * D + rows[:, None] * D + dims[None, :], mask=(rows < N)[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kb = KW.to(tl.pointer_type(tl.uint8))
    vb = VW.to(tl.pointer_type(tl.uint8))
    for start in range(0, N, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        codes_k = _bytes(kb, head * N * ROW_BYTES, keys, D, WIDTH)
        codes_v = _bytes(vb, head * N * ROW_BYTES, keys, D, WIDTH)
        m_i, l_i, acc = _online_softmax_step(q, codes_k, codes_v, m_i, l_i, acc)
    out = acc / l_i[:, None]
    tl.store(Out + head * N * D + rows[:, None] * D + dims[None, :], out, mask=(rows < N)[:, None])


def pack(codes: torch.Tensor, width: int) -> torch.Tensor:
    """[..., D] signed codes -> [..., D * width / 32] int32 words, code d in slot d % per_word of word d // per_word."""
    per_word = 32 // width
    unsigned = (codes + (1 << (width - 1))).to(torch.int64).reshape(*codes.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * width
    words = (unsigned << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def check(config, device: str, decode: str = "compact") -> tuple[bool, str]:
    d, width, block_m, block_n, warps, stages = config
    heads, n = 2, 512 if device == "cuda" else 64
    g = torch.Generator().manual_seed(d * 10 + width)
    q = (torch.randn(heads, n, d, generator=g) * 0.5).half()
    k_codes = torch.randint(-(1 << (width - 1)), 1 << (width - 1), (heads, n, d), generator=g)
    v_codes = torch.randint(-(1 << (width - 1)), 1 << (width - 1), (heads, n, d), generator=g)
    logits = (q.double() @ k_codes.double().transpose(-1, -2)) * 0.01
    reference = torch.softmax(logits, -1) @ v_codes.double()
    out = torch.empty(heads, n, d, dtype=torch.float32)
    args = [t.to(device) for t in (q, pack(k_codes, width), pack(v_codes, width), out)]
    grid = (triton.cdiv(n, block_m), heads)
    kernel = _kernel if decode == "compact" else _kernel_bytes
    kernel[grid](*args, n, D=d, WIDTH=width, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    result = args[3].cpu().double()
    err = (result - reference).abs().max().item()
    # float16 probabilities into the value product: relative 2**-11 of the output's scale
    tolerance = 2e-3 * (1 << (width - 1))
    return bool(err == err and err <= tolerance), f"max err {err:.3e} (tolerance {tolerance:.1e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="Triton's interpreter (set TRITON_INTERPRET=1)")
    parser.add_argument(
        "--decode",
        choices=("compact", "bytes"),
        default="compact",
        help="compact: [BLOCK_N, words] tiles expanded by join/reshape; bytes: byte tiles in plane order",
    )
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configs = CPU_CONFIGS if args.cpu else CONFIGS
    if args.one is not None:
        ok, message = check(configs[args.one], "cpu" if args.cpu else "cuda", args.decode)
        print(message)
        return 0 if ok else 1
    failures = 0
    for index, config in enumerate(configs):
        d, width, m, n, warps, stages = config
        label = f"d={d:3d} width={width} tile {m}x{n} warps {warps} stages {stages}"
        command = [sys.executable, __file__, "--one", str(index), "--decode", args.decode]
        command += ["--cpu"] if args.cpu else []
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            lines = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()
            verdict = "ok" if done.returncode == 0 else ("WRONG" if "max err" in lines[-1] else "CRASH")
            detail = lines[-1]
        except subprocess.TimeoutExpired:
            verdict, detail = "TIMEOUT", "over 300 s"
        failures += verdict != "ok"
        print(f"{label}: {verdict}: {detail}", flush=True)
    print(f"{failures} of {len(configs)} configurations failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
