"""Read bandwidth of the few-row linear kernels (yaied/kernels/cpu_gemv.c, cpu_quant.c) from memory.

One pass runs every linear layer of the default model's shapes (SmolLM2-135M: 30 layers of
q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536, and the 49152x576 LM head), each with
its own random bf16 weight, so that a pass reads 269 MB (8 times the L3 of the CPUs it was
written on) as a decode step does; ``--shape 1b`` runs Llama-3.2-1B's layers instead (with the
default model's vocabulary, as scripts/bench_llamacpp.py's 1B file). GB/s is those bytes over
the best pass of ``--rounds``. For reference, the same process measures ``torch.sum`` over one
tensor of the same bytes (a plain sequential read) and the copy bandwidth the W-single floor
uses (scripts/single_stream.py). One JSON line per (level, activations, rows).

``--weights q4_0|q4_1|q2_k|q3_k|q4_k|q5_k|q6_k|q8_0|iq4_nl|iq4_xs`` runs cpu_quant.c's kernel over
block tables of that type instead (random blocks; ``weights_g_s`` is weights a second, the
kernel's bound where it is arithmetic).

    PYTHONPATH=. .venv/bin/python scripts/bench_few_rows.py [--levels avx2,avx512_bf16] [--rows 1,8]
    PYTHONPATH=. .venv/bin/python scripts/bench_few_rows.py --weights q4_1 --rows 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from single_stream import copy_bandwidth

from yaied.kernels import cpu_quant
from yaied.kernels.cpu_gemv import CpuGemv
from yaied.kernels.cpu_isa import runnable_levels

# (layer shapes [(N, K)] of q/k/v, o, gate/up and down, layers, LM head)
SHAPES = {
    "default": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
    "1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16, (49152, 2048)),
}


def best_seconds(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def random_blocks(qtype: cpu_quant.QuantType, n: int, k: int) -> torch.Tensor:
    """A block table of random quants with small fp16 scales (and Q4_1 mins), [n, row bytes]."""
    blocks = torch.randint(0, 256, (n, k // qtype.block_size, qtype.block_bytes), dtype=torch.uint8)
    if qtype in (cpu_quant.Q6_K, cpu_quant.Q3_K):  # their scales, then d last
        at = qtype.block_bytes - 2
        blocks[:, :, at:] = torch.tensor([0.0002], dtype=torch.float16).view(torch.uint8)
        return blocks.reshape(n, -1).contiguous()
    halves = 2 if qtype in (cpu_quant.Q4_1, cpu_quant.Q4_K, cpu_quant.Q5_K, cpu_quant.Q2_K) else 1
    at = 80 if qtype is cpu_quant.Q2_K else 0  # d, then m or dmin: Q2_K's last
    for h in range(halves):
        value = torch.tensor([0.01 if h == 0 else -0.08], dtype=torch.float16)
        blocks[:, :, at + 2 * h : at + 2 * h + 2] = value.view(torch.uint8)
    return blocks.reshape(n, -1).contiguous()


def sum_seconds(weights: list[torch.Tensor], rounds: int) -> float:
    """torch.sum over one tensor of the weights' bytes: a plain sequential read. Block tables
    (uint8) are read as fp32 words: torch sums bytes into int64 at a small fraction of the
    bandwidth."""
    flat = torch.cat([w.flatten() for w in weights])
    if flat.dtype == torch.uint8:
        flat = flat[: flat.numel() // 4 * 4].view(torch.float32)
    return best_seconds(flat.sum, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    levels = ",".join(runnable_levels())
    parser.add_argument("--levels", default=levels, help="ISA levels, comma-separated")
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--weights",
        default="bf16",
        choices=["bf16", *cpu_quant.QUANT_TYPES],
    )
    parser.add_argument("--shape", default="default", choices=sorted(SHAPES))
    args = parser.parse_args()
    layer_shapes, layers, head = SHAPES[args.shape]
    shapes = layer_shapes * layers + [head]
    qtype = None if args.weights == "bf16" else getattr(cpu_quant, args.weights.upper())
    if qtype is not None and any(k % qtype.block_size for _, k in shapes):
        parser.error(f"--shape {args.shape} has rows that are not whole {args.weights} blocks")
    if qtype is None:
        weights = [(torch.randn(n, k) / k**0.5).to(torch.bfloat16) for n, k in shapes]
    else:
        weights = [random_blocks(qtype, n, k) for n, k in shapes]
        if qtype in cpu_quant.GROUPED:  # as the engine keeps Q4_0 and Q4_1 (QuantizedLinear)
            grouped = cpu_quant.GROUPED[qtype]
            weights = [cpu_quant.group_blocks(qtype, w)[1] for w in weights]
            qtype = grouped
    total = sum(w.numel() * w.element_size() for w in weights)
    num_weights = sum(n * k for n, k in shapes)

    read_s = sum_seconds(weights, args.rounds)
    print(
        json.dumps(
            {
                "case": "reference",
                "weights": args.weights,
                "bytes": total,
                "torch_sum_gb_s": round(total / read_s / 1e9, 1),
                "copy_bandwidth_gb_s": round(copy_bandwidth() / 1e9, 1),
            }
        )
    )
    for level in args.levels.split(","):
        kernels = CpuGemv.load(level, strict=True)
        if qtype is not None:
            kernels = cpu_quant.CpuQuant.load(level, strict=True)
        # bf16 activations where the level has bf16 dot products (bf16 math), else fp32
        dtypes = [torch.bfloat16, torch.float32] if level == "avx512_bf16" else [torch.float32]
        for dtype in dtypes:
            if qtype is None:
                bound = [kernels.bind(w, None, dtype) for w in weights]
            else:
                bound = [
                    kernels.bind(qtype, w, k, dtype=dtype)
                    for w, (_, k) in zip(weights, shapes, strict=True)
                ]
            for rows in (int(r) for r in args.rows.split(",")):
                inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}

                def one_pass(bound=bound, inputs=inputs) -> None:
                    for layer, (_, k) in zip(bound, shapes, strict=True):
                        layer(inputs[k])

                seconds = best_seconds(one_pass, args.rounds)
                record = {"level": kernels.level, "activations": str(dtype)[6:], "rows": rows}
                # three significant digits: a slow level on a busy machine is under 0.05
                record["gb_s"] = float(f"{total / seconds / 1e9:.3g}")
                record["weights_g_s"] = float(f"{num_weights / seconds / 1e9:.3g}")
                record["pass_ms"] = round(seconds * 1e3, 2)
                print(json.dumps(record), flush=True)
            del bound


if __name__ == "__main__":
    main()
