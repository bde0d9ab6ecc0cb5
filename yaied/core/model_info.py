"""One description of a loaded model, as every layer sees it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Found at start-up (never written back into config). The router's front end validates
    requests against the first two; the rest describe one engine's KV pool and are 0 or "" where
    unknown (a remote engine reports only its context length)."""

    max_model_len: int
    vocab_size: int
    num_pages: int = 0
    page_size: int = 0
    dtype: str = ""  # the math's (activations)
    device: str = ""
    weight_dtype: str = ""  # linear weights as stored (bfloat16 under fp32 math on most CPUs)
    cpu_isa: str = ""  # the ISA level the CPU kernels run at (yaied/kernels/cpu_isa.py)
    quantization: str = ""  # the block types of quantized projections ("q4_1"), "" for none
    kv_cache_dtype: str = ""  # the KV pools' (bfloat16 under fp32 math: cache.kv_cache_dtype)
