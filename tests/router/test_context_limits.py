"""Engines of one pool that hold different context lengths: the router takes calls up to the
largest an engine holds, sends each only to engines that hold it, and says the largest (in a
400 and in /v1/models) as the pool changes."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.router.test_manager import FakeEngine, params, started
from tests.server.test_engines_http import serve
from yaied.core.errors import ContextLengthError
from yaied.core.model_info import ModelInfo
from yaied.core.request import FinishReason, TokenEvent
from yaied.router.handle import Health

pytestmark = pytest.mark.timeout(60)


class SizedEngine(FakeEngine):
    """Holds ``limit`` tokens; a longer call fails, as a remote daemon's 400 fails it."""

    def __init__(self, engine_id: str, limit: int) -> None:
        super().__init__(engine_id)
        self.info = ModelInfo(limit, 256)
        self.too_long: list[str] = []

    def submit(self, request_id, prompt_ids, params, *, session_id, priority, sink):
        if len(prompt_ids) + params.max_tokens > self.info.max_model_len:
            self.too_long.append(request_id)
            error = f"400: prompt exceeds the model's context length of {self.info.max_model_len}"
            event = TokenEvent(request_id, [], "", FinishReason.ERROR, error=error)
            asyncio.get_running_loop().call_soon(sink.deliver, event)
            return
        super().submit(
            request_id, prompt_ids, params, session_id=session_id, priority=priority, sink=sink
        )


async def run(manager, prompt_len: int, n: int, max_tokens: int = 4) -> list:
    handles = [
        await manager.submit_request(prompt=[1] * prompt_len, sampling_params=params(max_tokens))
        for _ in range(n)
    ]
    return await asyncio.gather(*(h.result() for h in handles))


async def test_calls_go_only_to_engines_that_hold_them():
    manager, engines = await started(1)  # engine 0 holds 8192
    small = SizedEngine("1", 1024)
    manager.add_engine(small, origin="api")
    assert await manager.wait_started("1") == "up"
    long_calls, short_calls = await asyncio.gather(run(manager, 2000, 6), run(manager, 10, 6))
    assert [o.finish_reason for o in long_calls + short_calls] == [FinishReason.LENGTH] * 12
    assert small.too_long == []  # none was sent there
    assert small.seen  # the short ones still spread to it
    await manager.stop()


async def test_the_limit_follows_the_pool():
    manager, _ = await started(1)
    assert manager.info.max_model_len == 8192
    big = SizedEngine("1", 16384)
    manager.add_engine(big, origin="api")
    await manager.wait_started("1")
    assert manager.info.max_model_len == 16384
    [output] = await run(manager, 12000, 1)  # fits the new engine only
    assert output.finish_reason is FinishReason.LENGTH and big.seen
    await manager.remove_engine("1", timeout=0)
    assert manager.info.max_model_len == 8192
    with pytest.raises(ContextLengthError, match="context length of 8192 tokens"):
        await run(manager, 12000, 1)
    await manager.stop()


def test_v1_models_and_the_400_name_the_largest_engine_serving():
    with serve() as client:
        manager = client.app.state.server.manager

        def max_model_len() -> int:
            return client.get("/v1/models").json()["data"][0]["max_model_len"]

        assert max_model_len() == 8192
        client.portal.call(_add, manager, SizedEngine("1", 16384))
        assert max_model_len() == 16384
        body = {"prompt": [1] * 12000, "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        client.portal.call(manager.remove_engine, "1", 0)
        assert max_model_len() == 8192
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "context_length_exceeded" and "8192 tokens" in error["message"]


async def _add(manager, handle) -> None:
    manager.add_engine(handle, origin="api")
    deadline = time.monotonic() + 10
    while await manager.wait_started(handle.engine_id) != "up":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_a_call_without_max_tokens_fits_every_engine_up_that_holds_its_prompt():
    # Chat's default max_tokens is the context the call has left. Taken from the pool's largest
    # engine, a call that did not ask for a length went only to that engine, and got a 503
    # while it was down though the others were up: it is the smallest room left on an engine
    # up that holds the prompt.
    manager, engines = await started(1)  # engine 0 holds 8192
    big = SizedEngine("1", 16384)
    manager.add_engine(big, origin="api")
    await manager.wait_started("1")
    assert manager.room_for(100) == 8092  # both hold a 100-token prompt
    assert manager.room_for(10000) == 6384  # only the big one holds it
    engines[0].tick = big.tick = 0  # thousands of tokens a call
    outputs = await run(manager, 100, 6, max_tokens=manager.room_for(100))
    assert all(o.finish_reason is FinishReason.LENGTH for o in outputs)
    assert engines[0].seen and big.seen  # spread over both
    big.health = Health.DOWN
    assert manager.room_for(100) == 8092
    [output] = await run(manager, 100, 1, max_tokens=manager.room_for(100))
    assert output.finish_reason is FinishReason.LENGTH
    await manager.stop()


def test_a_call_only_a_down_engine_holds_is_a_503_with_retry_after():
    # README: such a call waits for the engine, so the client is told when to come back
    with serve() as client:
        manager = client.app.state.server.manager
        big = SizedEngine("1", 16384)
        client.portal.call(_add, manager, big)
        big.health = Health.DOWN
        answer = client.post("/v1/completions", json={"prompt": [1] * 12000, "max_tokens": 4})
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "1"
        assert "no engine up holds a call of 12004 tokens" in answer.json()["error"]["message"]
