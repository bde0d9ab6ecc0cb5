"""What bf16 KV pools under fp32 math cost in accuracy on the default model: the mean
log-likelihood per token of the held-out text (tests/worker/data/heldout.txt) with bf16 pools
against fp32 pools, both under ``--dtype float32``. Measured: 0.0001 nats/token; the limit is
0.005 (a tenth of the 4-bit weights' limit in test_quantized_accuracy.py)."""

from __future__ import annotations

import pytest

from tests.worker.test_quantized_accuracy import HELDOUT, mean_log_likelihood
from yaied import LLM

pytestmark = pytest.mark.slow


def test_bf16_pools_cost_next_to_nothing_in_log_likelihood():
    scores = {}
    for kv_cache_dtype in ("float32", "bfloat16"):
        with LLM(
            "smollm2-135m-instruct",
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=4096,
            kv_cache_gib=0.5,
            show_progress=False,
        ) as llm:
            assert llm.engine.worker.info.kv_cache_dtype == kv_cache_dtype
            ids = llm.tokenizer(HELDOUT.read_text())["input_ids"]
            scores[kv_cache_dtype] = mean_log_likelihood(llm, ids)
    diff = scores["bfloat16"] - scores["float32"]
    print(f"bf16 pools: {scores['bfloat16']:.5f} nats/token, fp32 {scores['float32']:.5f}")
    assert abs(diff) <= 0.005
