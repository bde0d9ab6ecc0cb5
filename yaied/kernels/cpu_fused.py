"""Launchers for the fused elementwise CPU kernels (cpu_fused.c), with the torch code each one
replaces as its reference: RMSNorm with the residual add, rotary embedding, SiLU-and-multiply
(and Qwen3's q/k norm before the rotary, composed here, one kernel on the GPU).

Each kernel makes one pass over its rows where torch makes 2 to 6 with a temporary each; the
launchers check only what the C side relies on (dtype, contiguity, sizes), since they run
several times per layer.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from yaied.kernels.cpu_build import KernelLibrary, load_library

SOURCE = Path(__file__).with_name("cpu_fused.c")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _I],
    "rotary": [_P, _I, _I, _I, _I, _P, _P, _I],
    "silu_mul": [_P, _P, _I, _I, _I],
}


class CpuFusedOps:
    """The compiled kernels; ``CpuFusedOps.load()`` returns None where they cannot be built."""

    device_type = "cpu"  # the tensors they take (TritonFusedOps: the GPU's)

    def __init__(self, library: KernelLibrary) -> None:
        self.level = library.level
        self._functions = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                function = getattr(library.cdll, f"{name}_{suffix}")
                function.argtypes = argtypes
                function.restype = None
                self._functions[name, dtype] = function
        self._argmax = library.cdll.argmax_rows_f32
        self._argmax.argtypes = [_P, _I, _I, _P, _I]
        self._argmax.restype = None
        self._bitmask = library.cdll.apply_token_bitmask_f32
        self._bitmask.argtypes = [_P, _I, _P, _I, _P, _I, _I]
        self._bitmask.restype = None

    @classmethod
    def load(
        cls, level: str | None = None, cache_dir: Path | None = None, *, strict: bool = False
    ) -> CpuFusedOps | None:
        library = load_library(SOURCE, level, cache_dir, strict=strict)
        return None if library is None else cls(library)

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _SUFFIX

    def add_rms_norm(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """residual += delta in place (when given); returns weight * rms_norm(residual).
        delta, residual: [rows, hidden] contiguous; weight: [hidden]; one dtype."""
        rows, hidden = residual.shape
        delta = check_add_rms_norm(delta, residual, weight)
        out = torch.empty_like(residual)
        self._functions["add_rms_norm", residual.dtype](
            None if delta is None else delta.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rotary(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first ``heads`` heads of every row of x in place (rotate-half layout).
        x: [rows, >= heads * head_dim] with unit stride along each row (a slice of the fused
        qkv output works); cos, sin: [rows, head_dim / 2] fp32 contiguous."""
        rows, half = cos.shape
        check_rotary(x, heads, cos, sin)
        self._functions["rotary", x.dtype](
            x.data_ptr(),
            x.stride(0),
            rows,
            heads,
            2 * half,
            cos.data_ptr(),
            sin.data_ptr(),
            torch.get_num_threads(),
        )

    def qk_norm_rotary(
        self,
        x: torch.Tensor,
        q_heads: int,
        k_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Qwen3's attention input, in place on the first q_heads + k_heads heads of every row
        of x (laid out as ``rotary``'s): each q head RMS-normalised with q_weight, each k head
        with k_weight ([head_dim] each), then both rotated. On CPU the norm is torch's (Qwen3 is
        not what this path is tuned for); TritonFusedOps does it all in one kernel."""
        check_qk_norm_rotary(x, q_heads + k_heads, q_weight, k_weight, cos, sin)
        rows, head_dim = x.shape[0], q_weight.shape[0]
        heads = x[:, : (q_heads + k_heads) * head_dim].view(rows, -1, head_dim)
        heads[:, :q_heads] = rms_norm_reference(heads[:, :q_heads], q_weight, eps)
        heads[:, q_heads:] = rms_norm_reference(heads[:, q_heads:], k_weight, eps)
        self.rotary(x, q_heads + k_heads, cos, sin)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling: logits [rows, n] -> int64 [rows], torch.argmax(logits, -1) (the first
        index of a row's maximum, a NaN counting as the largest), one pass from L2 where torch's
        took several times its amax. fp32 contiguous rows; anything else goes to torch."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
            return logits.argmax(dim=-1)
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows and n:
            self._argmax(logits.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
        elif rows:
            return logits.argmax(dim=-1)  # torch's own error for an empty row
        return out

    def apply_token_bitmask(
        self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int], vocab: int
    ) -> bool:
        """In place: logits[r, t] = -inf where bit t of mask[r] is 0, for r in ``rows`` and t
        below ``vocab`` (xgrammar.apply_token_bitmask_inplace with indices). fp32 contiguous
        logits and int32 contiguous masks with a row for every listed row; False (nothing done)
        for anything else, which the caller masks its own way."""
        if (
            logits.dtype != torch.float32
            or mask.dtype != torch.int32
            or logits.dim() != 2
            or mask.dim() != 2
            or not logits.is_contiguous()
            or not mask.is_contiguous()
            or not 0 <= vocab <= min(logits.shape[1], mask.shape[1] * 32)
            or any(not 0 <= r < min(logits.shape[0], mask.shape[0]) for r in rows)
        ):
            return False
        index = (ctypes.c_int64 * len(rows))(*rows)
        self._bitmask(
            logits.data_ptr(), logits.shape[1], mask.data_ptr(), mask.shape[1],
            ctypes.addressof(index), len(rows), vocab,
        )  # fmt: skip
        return True

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * width] contiguous -> silu(gate) * up, [rows, width]."""
        rows, double = gate_up.shape
        check_silu_mul(gate_up)
        out = gate_up.new_empty(rows, double // 2)
        self._functions["silu_mul", gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), rows, double // 2, torch.get_num_threads()
        )
        return out


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# What every implementation of the kernels relies on (TritonFusedOps checks the same).


def check_add_rms_norm(
    delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor | None:
    """residual [rows, hidden] and weight [hidden] contiguous, delta [rows, hidden] or None, one
    dtype; returns delta made contiguous."""
    hidden = residual.shape[1]
    _check(residual.is_contiguous() and weight.is_contiguous(), "tensors must be contiguous")
    _check(weight.shape == (hidden,) and weight.dtype == residual.dtype, "bad weight")
    if delta is None:
        return None
    _check(delta.shape == residual.shape and delta.dtype == residual.dtype, "bad delta")
    return delta.contiguous()


def check_rotary(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rows, half = cos.shape
    _check(x.dim() == 2 and x.shape[0] == rows and x.stride(1) == 1, "bad x")
    _check(x.shape[1] >= heads * 2 * half, "x is narrower than its heads")
    _check(cos.dtype == sin.dtype == torch.float32, "cos and sin must be fp32")
    _check(cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape, "bad sin")


def check_qk_norm_rotary(
    x: torch.Tensor,
    heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    check_rotary(x, heads, cos, sin)
    head_dim = 2 * cos.shape[1]
    for weight in (q_weight, k_weight):
        _check(weight.shape == (head_dim,) and weight.is_contiguous(), "bad q/k norm weight")
        _check(weight.dtype == x.dtype, "the q/k norm weights must have x's dtype")


def check_silu_mul(gate_up: torch.Tensor) -> None:
    _check(
        gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0, "gate_up must be contiguous, even"
    )


# The torch references: what the model computes without the kernels.


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and scale in the model dtype, as the Hugging Face implementation does.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [rows, heads, head_dim]; cos, sin: [rows, 1, head_dim] (both halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
