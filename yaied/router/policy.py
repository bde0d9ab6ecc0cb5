"""Routing: which engine takes a call. A pure function of explicit inputs, tested in milliseconds.

The Autellix rule, with SGLang's imbalance guard on top:

    call of <= long_call_threshold prompt tokens -> the least-loaded healthy engine
    longer call, session pinned to a healthy engine -> that engine (its KV cache holds the context)
        unless the engines are imbalanced: (max - min) > abs and max > rel * min  -> least-loaded
    longer call, no usable pin -> the least-loaded engine, which becomes the pin

Load is outstanding requests, ties broken by outstanding tokens, then by engine order. Unhealthy
engines are never chosen. ``round_robin`` and ``least_loaded`` exist for comparisons.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("autellix", "round_robin", "least_loaded")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine as the router sees it when a call arrives."""

    engine_id: str
    num_requests: int  # calls routed to it that have not finished
    num_tokens: int  # their prompt tokens plus max_tokens
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class RoutingThresholds:
    long_call_threshold: int = 2048  # prompt tokens; longer calls follow their session's pin
    imbalance_abs: int = 64  # the guard fires when max - min requests exceeds this ...
    imbalance_rel: float = 1.5  # ... and max exceeds this times min


@dataclass(frozen=True, slots=True)
class Route:
    """The decision: the engine, the session's new pin (None: leave the pin as it was), and why."""

    engine_id: str
    pin: str | None
    reason: str


def route(
    policy: str,
    loads: Sequence[EngineLoad],
    *,
    num_prompt_tokens: int,
    pinned: str | None = None,
    thresholds: RoutingThresholds = RoutingThresholds(),  # noqa: B008 (frozen: safe to share)
    turn: int = 0,
) -> Route | None:
    """The engine for one call, or None when no engine is healthy. ``turn`` is the caller's
    round-robin counter (the number of calls routed so far)."""
    if policy not in POLICIES:
        raise ValueError(f"router.policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    healthy = [load for load in loads if load.healthy]
    if not healthy:
        return None
    if policy == "round_robin":
        return Route(healthy[turn % len(healthy)].engine_id, None, "round_robin")
    least = least_loaded(healthy)
    if policy == "least_loaded":
        return Route(least.engine_id, None, "least_loaded")
    if num_prompt_tokens <= thresholds.long_call_threshold:
        return Route(least.engine_id, None, "short call: least loaded")
    pin = next((load for load in healthy if load.engine_id == pinned), None)
    if pin is None:
        return Route(least.engine_id, least.engine_id, "long call: new pin")
    if imbalanced(healthy, thresholds):
        # The guard sends the call to the shortest queue; the newest context now lives there.
        return Route(least.engine_id, least.engine_id, "long call: imbalance guard")
    return Route(pin.engine_id, None, "long call: pinned")


def least_loaded(loads: Sequence[EngineLoad]) -> EngineLoad:
    """Fewest outstanding requests, then fewest outstanding tokens; the first such engine wins."""
    return min(loads, key=lambda load: (load.num_requests, load.num_tokens))


def imbalanced(loads: Sequence[EngineLoad], thresholds: RoutingThresholds) -> bool:
    """SGLang's guard: both the absolute and the relative gap in requests are exceeded."""
    counts = [load.num_requests for load in loads]
    high, low = max(counts), min(counts)
    return high - low > thresholds.imbalance_abs and high > thresholds.imbalance_rel * low
