"""The engine's counters and gauges, named once.

Three layers speak these names: the engine's ``stats()`` (engine/async_engine.py), the server's
Prometheus collector (server/metrics.py) and the router's reader of a remote daemon's /metrics
(router/remote_metrics.py). Each used to keep its own list and they drifted (a router over remote
daemons dropped the speculative-decoding counters and the restarts), so all three read this table:
a name added here is exported by the server and carried over by a router.

To add one: give it a key and a help line in ENGINE_GAUGES or ENGINE_COUNTERS, and make the
engine's stats() report that key. The Prometheus name is ``yaied:<key>`` (counters get ``_total``).
"""

from __future__ import annotations

PREFIX = "yaied:"

# Gauges, read at scrape time. A router adds up remote engines' gauges, except the KV usage, which
# is a ratio: it averages those (ENGINE_AVERAGED).
ENGINE_GAUGES: dict[str, str] = {
    "num_requests_running": "Requests running (holding KV pages).",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "KV cache pages held by requests (0-1).",
}
ENGINE_AVERAGED = frozenset({"kv_cache_usage_perc"})

# Counters, monotonic over the engine's life; a router adds up remote engines' counters.
ENGINE_COUNTERS: dict[str, str] = {
    "prefix_cache_queries": "Prompt tokens looked up.",
    "prefix_cache_hits": "Prompt tokens found in the cache.",
    "num_preemptions": "Requests preempted.",
    "num_steps_ahead": (
        "Engine steps launched before the one before them ended (engine.overlap_steps)."
    ),
    "structured_output_mask_seconds": (
        "Seconds spent filling and applying grammar token masks (the steps with a "
        "constrained row: structured_output_masked_steps)."
    ),
    "structured_output_masked_steps": "Engine steps with at least one constrained row.",
    # Speculative decoding, as vLLM names it; mean acceptance length is
    # 1 + accepted_tokens / drafts (tokens per step of a drafting sequence).
    "spec_decode_num_drafts": "Sequence-steps that carried draft tokens.",
    "spec_decode_num_draft_tokens": "Draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
}

# Stats keys engine_restarts_<reason> are one counter, yaied:engine_restarts_total{reason}.
RESTARTS = "engine_restarts"
RESTARTS_PREFIX = f"{RESTARTS}_"
RESTARTS_DOC = "In-process engine rebuilds after a fault, by reason (see yaied/engine/faults.py)."


def restarts_key(reason: str) -> str:
    """The stats key of one restart reason's count."""
    return f"{RESTARTS_PREFIX}{reason}"


# The router's calls that outlived their engine, yaied:call_migrations_total{outcome}: "moved" (it
# went on on another engine), "failed" (no engine could take it, or it had moved twice already:
# it ended with an error event). Counted by the router (router/manager.py), not by an engine.
CALL_MIGRATIONS = "call_migrations"
CALL_MIGRATIONS_DOC = "Calls whose engine went (removed, lost, died), by outcome (moved, failed)."
MIGRATION_OUTCOMES = ("moved", "failed")


# The Gateway API Inference Extension's model-server protocol: its endpoint picker (llm-d, KServe,
# Envoy AI Gateway) reads a pod's queue length, running requests and KV-cache usage, by default
# under vLLM's names (older pickers read the usage as gpu_cache_usage_perc). The server exports
# the pod's totals under them too (queues added up over its engines, the usage averaged), beside
# the yaied: names, with the model_name label only. Its LoRA-affinity scorer reads
# LORA_REQUESTS_INFO, whose labels name the adapters running and waiting: yaied serves none.
INFERENCE_EXTENSION_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_running": ("vllm:num_requests_running",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
