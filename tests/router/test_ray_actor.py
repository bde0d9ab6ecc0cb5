"""The Ray actor's event stream, driven without Ray: EngineActor is a plain class until
router/ray_handle.py wraps it. A call's first and final events leave at once; its middle tokens
wait for company (an item costs both sides as much CPU as a short step)."""

from __future__ import annotations

import asyncio

from yaied.core.request import FinishReason, TokenEvent
from yaied.router import ray_actor
from yaied.router.ray_actor import EngineActor


def _event(request_id: str, token: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent(request_id, [token], "", finish)


async def test_middle_tokens_wait_for_the_next_item_first_and_final_do_not(monkeypatch):
    monkeypatch.setattr(ray_actor, "HOLD_SECONDS", 60.0)  # held events leave only with another
    monkeypatch.setattr(ray_actor, "STATS_INTERVAL", 60.0)
    actor = EngineActor("e0", config=None, threads=1)  # type: ignore[arg-type]
    stream = actor.events()
    assert await asyncio.wait_for(anext(stream), 5) == ([], None, [])  # the first stats item

    first = _event("a", 1)
    actor._send(first)
    assert (await asyncio.wait_for(anext(stream), 5))[0] == [first]  # a first token: at once

    middle = [_event("a", 2), _event("a", 3)]
    pending = asyncio.ensure_future(anext(stream))
    for event in middle:
        actor._send(event)
    await asyncio.sleep(0.05)
    assert not pending.done()  # held: no item for middle tokens alone

    other_first, final = _event("b", 7), _event("a", 4, FinishReason.LENGTH)
    actor._send(other_first)  # another call's first token takes the held ones along
    assert (await asyncio.wait_for(pending, 5))[0] == [*middle, other_first]

    actor._send(_event("b", 8))
    actor._send(final)  # a final event leaves at once, with what waited before it
    assert (await asyncio.wait_for(anext(stream), 5))[0] == [_event("b", 8), final]
    assert actor._started == {"b"}  # a finished call is forgotten
    await stream.aclose()
