"""Micro-benchmarks of the CPU kernels against the torch code they replace, in one process.

The x.clone() of the norm cases is timed on both sides (the kernel adds into the residual in
place). The decode-attention cases have no torch side: each times the kernel's pass over a
step's K/V from memory (W-mixed's, W-single's, one long row) and reports the bytes it read per
second; `--decode-only` runs just those.

Each case times the kernel and its torch reference alternately (paired, interleaved), several
rounds, and keeps the best round of each: on a shared 2-core machine the best round is the
least disturbed one. One JSON line per case on stdout.

    PYTHONPATH=. .venv/bin/python scripts/bench_kernels.py [--rounds 7] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from yaied.kernels.cpu_decode import CpuDecodeKernel
from yaied.kernels.cpu_fused import (
    CpuFusedOps,
    rms_norm_reference,
    rotary_reference,
    silu_mul_reference,
)
from yaied.kernels.cpu_prefill import CpuPrefillKernel
from yaied.worker.attention import PrefillChunk, _prefill_attention


def best_pair(
    ours: Callable[[], object], theirs: Callable[[], object], rounds: int, calls: int
) -> tuple[float, float]:
    """Best seconds per call of each, timed in alternating rounds after one warm-up call."""
    ours(), theirs()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((ours, theirs)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return best[0], best[1]


def matmul_gflops(dtype: torch.dtype, rounds: int) -> float:
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    seconds, _ = best_pair(lambda: a @ b, lambda: None, rounds, 4)
    return 2 * 1024**3 / seconds / 1e9


def prefill_case(kernel, dtype, n, start_pos, kv_heads, group, head_dim, rounds) -> dict:
    """One chunk of n tokens at start_pos over a paged context (page size 16, shuffled pages);
    the torch side is the engine's torch path: causal SDPA (fresh) or gather + masked SDPA.
    The kernel runs the path its ``use_amx`` / ``use_bf16_dot`` switches leave it."""
    page_size, context = 16, start_pos + n
    num_pages = -(-context // page_size)
    k_cache = torch.randn(kv_heads, num_pages, page_size, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    pages = torch.randperm(num_pages)
    q = torch.randn(n, kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    # Fresh chunks hand SDPA their own K/V, as the torch path does.
    rows = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:context]
    k = k_cache.view(kv_heads, -1, head_dim)[:, rows[start_pos:]].transpose(0, 1).contiguous()
    v = v_cache.view(kv_heads, -1, head_dim)[:, rows[start_pos:]].transpose(0, 1).contiguous()
    mask = None
    if start_pos:
        mask = torch.arange(context)[None, :] <= torch.arange(start_pos, context)[:, None]
    chunk = PrefillChunk(0, n, pages if start_pos else None, mask)
    out = torch.empty_like(q)
    ours, theirs = best_pair(
        lambda: kernel(q, k_cache, v_cache, pages, start_pos, scale, out=out),
        lambda: _prefill_attention(q, k, v, k_cache, v_cache, chunk, scale),
        rounds,
        3,
    )
    # Causal attention: QK^T and PV over the visible (query, key) pairs.
    pairs = n * start_pos + n * (n + 1) / 2
    flops = 4 * pairs * head_dim * kv_heads * group
    return {
        "case": f"prefill n={n} start={start_pos} kv={kv_heads} group={group} d={head_dim}",
        "dtype": str(dtype).removeprefix("torch."),
        "path": kernel.path(dtype, head_dim),
        "kernel_ms": round(ours * 1e3, 3),
        "torch_ms": round(theirs * 1e3, 3),
        "speedup": round(theirs / ours, 2),
        "kernel_gflops": round(flops / ours / 1e9, 1),
        "torch_gflops": round(flops / theirs / 1e9, 1),
    }


def fused_cases(ops: CpuFusedOps, dtype: torch.dtype, rows: int, rounds: int) -> list[dict]:
    """The default model's elementwise work per layer: hidden 576, 9 + 3 heads of 64, MLP 1536."""
    hidden, heads, kv_heads, head_dim, inter = 576, 9, 3, 64, 1536
    x, delta = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = torch.rand(hidden).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    freqs = torch.rand(rows, head_dim // 2) * 100
    cos, sin = freqs.cos(), freqs.sin()
    cos2, sin2 = (torch.cat((t, t), -1)[:, None].to(dtype) for t in (cos, sin))
    gate_up = torch.randn(rows, 2 * inter).to(dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim

    def torch_rotary():
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        rotary_reference(q.view(rows, heads, -1), cos2, sin2)
        rotary_reference(k.view(rows, kv_heads, -1), cos2, sin2)

    cases = {
        "residual add + rms_norm": (
            lambda: ops.add_rms_norm(delta, x.clone(), weight, 1e-5),
            lambda: rms_norm_reference(x.clone() + delta, weight, 1e-5),
        ),
        "rotary q and k": (lambda: ops.rotary(qkv, heads + kv_heads, cos, sin), torch_rotary),
        "silu_mul": (lambda: ops.silu_mul(gate_up), lambda: silu_mul_reference(gate_up)),
    }
    results = []
    for name, (ours, theirs) in cases.items():
        kernel_s, torch_s = best_pair(ours, theirs, rounds, 20)
        results.append(
            {
                "case": f"{name} rows={rows}",
                "dtype": str(dtype).removeprefix("torch."),
                "kernel_us": round(kernel_s * 1e6, 1),
                "torch_us": round(torch_s * 1e6, 1),
                "speedup": round(torch_s / kernel_s, 2),
            }
        )
    return results


def decode_step_case(
    kernel: CpuDecodeKernel,
    dtype: torch.dtype,
    rounds: int,
    rows: int,
    lengths: tuple[int, int],
    layers: int = 30,
) -> dict:
    """A decode step's attention from memory: `rows` rows whose contexts are `lengths` (low,
    high) positions, the default model's heads (3 kv heads of 3 query heads, head_dim 64),
    16-position pages scattered over the pool, and 30 layers' caches (so that a pass reads K/V
    from memory, as in a step, not from the last layer's pass in cache). W-mixed's step: 32
    rows of 64 to 576; W-single's: one row of 512 to 768. With `layers=1` the one layer's K/V
    stays in cache from pass to pass: the kernel's arithmetic alone, scaled to 30 layers."""
    kv_heads, group, head_dim, page_size = 3, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(lengths[0], lengths[1] + 1, (rows,), generator=gen)
    max_pages = -(-lengths[1] // page_size)
    num_pages = 2 * rows * max_pages
    table = torch.randperm(num_pages, generator=gen)[: rows * max_pages].view(rows, max_pages)
    shape = (kv_heads, num_pages, page_size, head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
    q = torch.randn(rows, kv_heads * group, head_dim).to(dtype)

    def step() -> None:
        for _ in range(30 // layers):  # 30 layers' calls either way
            for k_cache, v_cache in caches:
                kernel(q, k_cache, v_cache, table, lens, head_dim**-0.5)

    seconds, _ = best_pair(step, lambda: None, rounds, 1)
    read = 2 * int(lens.sum()) * kv_heads * head_dim * q.element_size() * 30
    where = "from memory" if layers == 30 else "one layer's K/V in cache"
    return {
        "case": f"decode attention, {rows} rows of {lengths[0]}-{lengths[1]} positions, "
        f"30 layers, {where}",
        "dtype": str(dtype)[6:],
        "ms": round(seconds * 1e3, 3),
        # three significant digits: a round stalled by a busy machine (the test suite runs this
        # beside other tests, one round) reads well under 0.05 GB/s, which one decimal shows as 0
        "kv_gb_s": float(f"{read / seconds / 1e9:.3g}"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "both"], default="both")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = every core")
    parser.add_argument("--decode-only", action="store_true", help="only the decode cases")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = (
        [torch.bfloat16, torch.float32] if args.dtype == "both" else [getattr(torch, args.dtype)]
    )
    kernel, ops, decode = CpuPrefillKernel.load(), CpuFusedOps.load(), CpuDecodeKernel.load()
    if kernel is None or ops is None or decode is None:
        raise SystemExit("the CPU kernels could not be built (no C compiler?)")
    torch.manual_seed(0)
    for dtype in dtypes:
        # W-mixed's step (32 rows of 64-576), W-single's (one row of 512-768), one long row
        for rows, lengths in ((32, (64, 576)), (1, (512, 768)), (1, (2048, 2048))):
            print(json.dumps(decode_step_case(decode, dtype, args.rounds, rows, lengths)))
        # W-single's row again, its K/V in cache: how much of the step is arithmetic
        print(json.dumps(decode_step_case(decode, dtype, args.rounds, 1, (512, 768), layers=1)))
        if args.decode_only:
            continue
        peak = matmul_gflops(dtype, args.rounds)
        print(json.dumps({"case": "matmul 1024^3", "dtype": str(dtype)[6:], "gflops": round(peak)}))
        # Where the CPU has AMX, bf16 runs on the tiles and again with AVX512-BF16 dots alone.
        amx_choices = [True, False] if dtype == torch.bfloat16 and kernel.has_amx else [True]
        for use_amx in amx_choices:
            kernel.use_amx = use_amx
            # The default model's shape (SmolLM2-135M): 3 kv heads of 9 query heads, head_dim
            # 64; 80 new tokens over 304 and 608 cached: turns of a chained conversation.
            cases = [(512, 0), (511, 0), (128, 0), (512, 1024), (64, 2000), (80, 304), (80, 608)]
            for n, start in cases:
                print(json.dumps(prefill_case(kernel, dtype, n, start, 3, 3, 64, args.rounds)))
            print(json.dumps(prefill_case(kernel, dtype, 512, 0, 8, 4, 128, args.rounds)))
        kernel.use_amx = True
        for rows in (512, 32, 1):
            for result in fused_cases(ops, dtype, rows, args.rounds):
                print(json.dumps(result))


if __name__ == "__main__":
    main()
