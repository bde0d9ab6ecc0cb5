"""Routing is a pure function: each rule of the Autellix policy and the imbalance guard."""

from __future__ import annotations

import pytest

from yaied.router.policy import EngineLoad, RoutingThresholds, imbalanced, route

SHORT, LONG = 100, 3000


def loads(*requests: int, tokens: tuple[int, ...] = (), down: tuple[str, ...] = ()):
    tokens = tokens or (0,) * len(requests)
    return [
        EngineLoad(str(i), n, t, healthy=str(i) not in down)
        for i, (n, t) in enumerate(zip(requests, tokens, strict=True))
    ]


def test_short_calls_go_to_the_least_loaded_engine_and_ignore_pins():
    decision = route("autellix", loads(3, 1, 2), num_prompt_tokens=SHORT, pinned="0")
    assert decision.engine_id == "1" and decision.pin is None


def test_ties_break_on_outstanding_tokens_then_engine_order():
    assert (
        route("autellix", loads(2, 2, tokens=(900, 100)), num_prompt_tokens=SHORT).engine_id == "1"
    )
    assert route("autellix", loads(2, 2, tokens=(5, 5)), num_prompt_tokens=SHORT).engine_id == "0"


def test_the_threshold_is_inclusive_for_short_calls():
    at = route("autellix", loads(5, 0), num_prompt_tokens=2048, pinned="0")
    above = route("autellix", loads(5, 0), num_prompt_tokens=2049, pinned="0")
    assert at.engine_id == "1" and above.engine_id == "0"


def test_a_long_call_without_a_pin_pins_the_least_loaded_engine():
    decision = route("autellix", loads(4, 2, 3), num_prompt_tokens=LONG)
    assert (decision.engine_id, decision.pin) == ("1", "1")


def test_a_long_call_follows_its_pin_even_to_a_busier_engine():
    decision = route("autellix", loads(10, 0), num_prompt_tokens=LONG, pinned="0")
    assert (decision.engine_id, decision.pin) == ("0", None)


def test_the_imbalance_guard_overrides_the_pin_and_moves_it():
    decision = route("autellix", loads(100, 10), num_prompt_tokens=LONG, pinned="0")
    assert (decision.engine_id, decision.pin) == ("1", "1")
    assert decision.reason == "long call: imbalance guard"


@pytest.mark.parametrize(
    ("high", "low", "fires"),
    [(65, 0, True), (64, 0, False), (100, 66, False), (300, 200, False), (300, 199, True)],
)
def test_imbalance_needs_both_the_absolute_and_the_relative_gap(high, low, fires):
    assert imbalanced(loads(high, low), RoutingThresholds()) is fires


def test_custom_thresholds():
    thresholds = RoutingThresholds(long_call_threshold=10, imbalance_abs=2, imbalance_rel=1.2)
    decision = route(
        "autellix", loads(5, 2), num_prompt_tokens=11, pinned="0", thresholds=thresholds
    )
    assert decision.engine_id == "1"


def test_unhealthy_engines_are_never_chosen():
    down_pin = route("autellix", loads(0, 5, down=("0",)), num_prompt_tokens=LONG, pinned="0")
    assert (down_pin.engine_id, down_pin.pin) == ("1", "1")  # the pin moves off the dead engine
    short = route("autellix", loads(0, 5, down=("0",)), num_prompt_tokens=SHORT)
    assert short.engine_id == "1"
    for policy in ("round_robin", "least_loaded"):
        both_down = loads(0, 9, 0, down=("0", "2"))
        chosen = {route(policy, both_down, num_prompt_tokens=1, turn=t).engine_id for t in range(5)}
        assert chosen == {"1"}


def test_no_healthy_engine_gives_none():
    assert route("autellix", loads(0, 0, down=("0", "1")), num_prompt_tokens=SHORT) is None


def test_round_robin_cycles_and_least_loaded_ignores_pins():
    order = [route("round_robin", loads(9, 0, 0), num_prompt_tokens=LONG, turn=t).engine_id
             for t in range(4)]  # fmt: skip
    assert order == ["0", "1", "2", "0"]
    decision = route("least_loaded", loads(5, 1), num_prompt_tokens=LONG, pinned="0")
    assert (decision.engine_id, decision.pin) == ("1", None)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="router.policy must be one of"):
        route("random", loads(0), num_prompt_tokens=1)
