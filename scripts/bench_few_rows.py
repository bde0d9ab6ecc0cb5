"""Read bandwidth of the few-row linear kernel (yaied/kernels/cpu_gemv.c) from memory.

One pass runs every linear layer of the default model's shapes (SmolLM2-135M: 30 layers of
q/k/v 960x576, o 576x576, gate/up 3072x576, down 576x1536, and the 49152x576 LM head), each with
its own random bf16 weight, so that a pass reads 269 MB (8 times the L3 of the CPUs it was
written on) as a decode step does. GB/s is those bytes over the best pass of ``--rounds``. For
reference, the same process measures ``torch.sum`` over one tensor of the same bytes (a plain
sequential read) and the copy bandwidth the W-single floor uses (scripts/single_stream.py). One
JSON line per (level, activations, rows).

    PYTHONPATH=. .venv/bin/python scripts/bench_few_rows.py [--levels avx2,avx512_bf16] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from single_stream import copy_bandwidth

from yaied.kernels.cpu_gemv import CpuGemv
from yaied.kernels.cpu_isa import runnable_levels

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)


def best_seconds(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def sum_seconds(weights: list[torch.Tensor], rounds: int) -> float:
    """torch.sum over one tensor of the weights' bytes: a plain sequential read."""
    flat = torch.cat([w.flatten() for w in weights])
    return best_seconds(flat.sum, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    levels = ",".join(runnable_levels())
    parser.add_argument("--levels", default=levels, help="ISA levels, comma-separated")
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shapes = LAYER_SHAPES * LAYERS + [HEAD]
    weights = [(torch.randn(n, k) / k**0.5).to(torch.bfloat16) for n, k in shapes]
    total = sum(w.numel() * 2 for w in weights)

    read_s = sum_seconds(weights, args.rounds)
    print(
        json.dumps(
            {
                "case": "reference",
                "bytes": total,
                "torch_sum_gb_s": round(total / read_s / 1e9, 1),
                "copy_bandwidth_gb_s": round(copy_bandwidth() / 1e9, 1),
            }
        )
    )
    for level in args.levels.split(","):
        gemv = CpuGemv.load(level, strict=True)
        # bf16 activations where the level has bf16 dot products (bf16 math), else fp32
        dtypes = [torch.bfloat16, torch.float32] if level == "avx512_bf16" else [torch.float32]
        for dtype in dtypes:
            bound = [gemv.bind(w, None, dtype) for w in weights]
            for rows in (int(r) for r in args.rows.split(",")):
                inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}

                def one_pass(bound=bound, inputs=inputs) -> None:
                    for layer, (_, k) in zip(bound, shapes, strict=True):
                        layer(inputs[k])

                seconds = best_seconds(one_pass, args.rounds)
                record = {"level": gemv.level, "activations": str(dtype)[6:], "rows": rows}
                record["gb_s"] = round(total / seconds / 1e9, 1)
                record["pass_ms"] = round(seconds * 1e3, 2)
                print(json.dumps(record), flush=True)
            del bound


if __name__ == "__main__":
    main()
