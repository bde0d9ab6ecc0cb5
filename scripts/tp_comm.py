"""Tensor-parallel communication counters for scripts/bench_offline.py."""

from __future__ import annotations

from typing import Any


def comm_counters(llm: Any) -> dict[str, float]:
    """Rank 0's seconds inside collectives (waits for slower ranks included: on CPU this is
    communication plus imbalance between ranks) and how many it ran; {} at TP=1."""
    group = getattr(llm.engine.worker.parallel, "group", None)
    if group is None:
        return {}
    return {"comm_s": group.comm_seconds, "num_collectives": group.num_collectives}


def comm_record(deltas: dict[str, float], elapsed: float) -> dict[str, float]:
    """Per engine step, and as a share of the wall time."""
    if "comm_s" not in deltas:
        return {}
    return {
        "comm_ms_per_step": round(1e3 * deltas["comm_s"] / deltas["num_steps"], 2),
        "collectives_per_step": round(deltas["num_collectives"] / deltas["num_steps"], 1),
        "comm_share": round(deltas["comm_s"] / elapsed, 3),
    }
