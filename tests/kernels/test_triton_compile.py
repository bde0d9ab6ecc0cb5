"""Every Triton kernel compiles to an sm_90 (H100) cubin with the engine's shapes, checked on any
box: Triton's bundled ptxas needs no GPU. This catches what the interpreter cannot (types, layout
and shared-memory limits of the real code generator). It runs in a subprocess without
TRITON_INTERPRET, so that the kernels there are compiled functions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COMPILE_ALL = r"""
import warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from yaied.kernels import triton_decode, triton_extend, triton_fused, triton_store_kv

H100_SHARED_BYTES = 227 * 1024

def compile_kernel(fn, dtype, constexprs):
    pointers = {"table_ptr": "*i32", "lens_ptr": "*i32", "starts_ptr": "*i32",
                "slot_ptr": "*i64", "lse_ptr": "*fp32", "part_ptr": "*fp32",
                "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*" + dtype)
        else:
            signature[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.metadata.shared <= H100_SHARED_BYTES, (fn.__name__, kernel.metadata.shared)
    print(fn.__name__, dtype, kernel.metadata.shared)

for dtype, precision, block in (("bf16", "tf32", 64), ("fp32", "ieee", 32)):
    compile_kernel(triton_decode._decode_split_kernel, dtype, dict(
        GROUP=2, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, BLOCK_D=128,
        BLOCK_N=64, PRECISION=precision, UPCAST=False))
    compile_kernel(triton_extend._extend_kernel, dtype, dict(
        GROUP=2, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=block, BLOCK_N=block, BLOCK_D=128,
        PRECISION=precision, UPCAST=False))
compile_kernel(triton_decode._decode_split_kernel, "bf16", dict(  # Llama-3.2-1B: group 4, d 64
    GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, BLOCK_H=16, BLOCK_D=64,
    BLOCK_N=64, PRECISION="tf32", UPCAST=False))
compile_kernel(triton_decode._decode_merge_kernel, "bf16", dict(
    HEAD_DIM=64, BLOCK_S=16, BLOCK_D=64))
compile_kernel(triton_store_kv._store_kv_kernel, "bf16", dict(
    KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
for dtype in ("bf16", "fp32"):  # Qwen3-0.6B: hidden 1024, 16 heads of 128, MLP 3072
    compile_kernel(triton_fused._add_rms_norm_kernel, dtype, dict(HAS_DELTA=True, BLOCK=1024))
    for norm, block_h in ((False, 32), (True, 32)):  # q and k heads: 16 + 8
        compile_kernel(triton_fused._rotary_kernel, dtype, dict(
            NORM=norm, HALF=64, BLOCK_H=block_h, BLOCK_HALF=64))
    compile_kernel(triton_fused._silu_mul_kernel, dtype, dict(BLOCK=1024))
print("compiled")
"""


def _has_cuda_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _has_cuda_backend(), reason="Triton has no CUDA backend here")
def test_kernels_compile_for_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL], capture_output=True, text=True, env=env, timeout=220
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("compiled"), result.stdout
