"""The remote handle's pieces: the circuit breaker, the request body, the SSE reader; and the
router's config section."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from yaied.core.request import FinishReason, SamplingParams
from yaied.router.config import EngineEntry, RouterConfig, load_router_config
from yaied.router.remote import CircuitBreaker
from yaied.router.remote_metrics import stats_from_metrics
from yaied.router.remote_stream import request_body, sse_events


def test_breaker_goes_down_after_three_failures_and_up_after_two_successes():
    breaker = CircuitBreaker(3, 2)
    assert [breaker.record(False) for _ in range(3)] == [None, None, False]
    assert not breaker.up
    assert breaker.record(True) is None and breaker.record(False) is None  # not two in a row
    assert breaker.record(True) is None and breaker.record(True) is True and breaker.up
    assert breaker.record(False) is None and breaker.record(True) is None  # a success resets


def test_request_body_carries_every_sampling_parameter():
    params = SamplingParams(max_tokens=5, temperature=0.5, stop=["x"], logit_bias={3: 1.0}, seed=7)
    body = request_body([1, 2], params, priority=2)
    assert body["prompt"] == [1, 2] and body["stream"] and body["return_token_ids"]
    assert body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (5, 0.5, 7)
    assert body["stop"] == ["x"] and body["logit_bias"] == {"3": 1.0} and body["priority"] == 2


def sse(*chunks: dict | str) -> httpx.Response:
    lines = [f"data: {c if isinstance(c, str) else orjson.dumps(c).decode()}\n\n" for c in chunks]
    return httpx.Response(200, content="".join(lines).encode())


def choice(text: str, ids: list[int], finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}


async def collect(response: httpx.Response) -> list:
    return [event async for event in sse_events(response, "r", 4)]


async def test_sse_events_hold_the_final_event_for_the_cached_tokens():
    usage = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}, "choices": []}
    response = sse(
        choice("a", [5]), choice("b", [6], "length"), {**usage, "usage": usage}, "[DONE]"
    )
    events = await collect(response)
    assert [e.token_ids for e in events] == [[5], [6]]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert (events[-1].num_cached_tokens, events[-1].num_output_tokens) == (3, 2)


async def test_sse_error_chunks_and_truncated_streams():
    events = await collect(sse(choice("a", [5]), {"error": {"message": "boom"}}))
    assert events[-1].finish_reason is FinishReason.ERROR and events[-1].error == "boom"
    from yaied.router.handle import EngineUnavailable

    with pytest.raises(EngineUnavailable):
        await collect(sse(choice("a", [5])))


async def test_sse_lines_end_any_way_and_are_bounded(monkeypatch):
    from yaied.router import remote_stream

    body = "data: " + orjson.dumps(choice("a", [5], "stop")).decode() + "\r\n\r\ndata: [DONE]\r"
    events = await collect(httpx.Response(200, content=body.encode()))
    assert [e.token_ids for e in events] == [[5]] and events[0].finish_reason is FinishReason.STOP
    monkeypatch.setattr(remote_stream, "MAX_LINE_BYTES", 64)
    for endless in (b"data: " + b"x" * 100, b"data: " + b"x" * 100 + b"\n\n"):
        with pytest.raises(remote_stream.LineTooLong):
            await collect(httpx.Response(200, content=endless))


def test_remote_metrics_become_engine_stats():
    text = (
        'yaied:num_requests_running{model_name="m",engine="0"} 2\n'
        'yaied:num_requests_running{model_name="m",engine="1"} 1\n'
        'yaied:kv_cache_usage_perc{model_name="m",engine="0"} 0.5\n'
        'yaied:kv_cache_usage_perc{model_name="m",engine="1"} 0.25\n'
    )
    stats = stats_from_metrics(text)
    assert stats["num_requests_running"] == 3 and stats["kv_cache_usage_perc"] == 0.375


def test_router_config_from_toml_env_and_overrides(tmp_path):
    path = tmp_path / "yaied.toml"
    path.write_text(
        '[router]\npolicy = "round_robin"\nlong_call_threshold = 100\n'
        '[[engines]]\nkind = "local"\ndevice = "cpu"\nthreads = 2\n'
        '[[engines]]\nkind = "remote"\nurl = "http://10.0.0.2:8000"\n'
    )
    env = {"YAIED_ROUTER_LONG_CALL_THRESHOLD": "200"}
    config, engines = load_router_config(path, env=env, overrides={"engines": 3})
    assert (config.policy, config.long_call_threshold, config.engines) == ("round_robin", 200, 3)
    assert engines == (
        EngineEntry(kind="local", device="cpu", threads=2),
        EngineEntry(kind="remote", url="http://10.0.0.2:8000"),
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[router]\npolicy = "random"\n', "router.policy must be one of"),
        ("[router]\nfoo = 1\n", "unknown setting"),
        ('[router]\nengines = "2"\n', "router.engines must be a int"),
        ('[[engines]]\nkind = "remote"\n', "a remote engine needs url"),
        ('[[engines]]\nkind = "gpu"\n', "engines.kind must be local, remote or ray"),
        ("[[engines]]\nport = 1\n", "unknown setting engines.port"),
        # urllib's errors (and a duplicate name) came only at load, after the daemon listened,
        # with a traceback in the log; now the config is refused before
        ('[[engines]]\nkind = "remote"\nurl = "http://[::1"\n', "needs url.*Invalid IPv6"),
        ('[[engines]]\nkind = "remote"\nurl = "http://h:99999"\n', "needs url.*out of range"),
        ('[[engines]]\nkind = "remote"\nurl = "http://"\n', "needs url.*no host"),
        ('[[engines]]\nname = "a"\n[[engines]]\nname = "a"\n', "share a name: a"),
        # resources as a list was a TypeError (a 500 over POST /v1/engines, a traceback at start)
        ('[[engines]]\nkind = "ray"\nresources = [1, 2]\n', "resources must be a table"),
        ('[[engines]]\nkind = "ray"\nresources = "CPU"\n', "resources must be a table"),
        ('[[engines]]\ndevice_ids = "0"\n', "device_ids must be a list of integers"),
        # accepted, then the engine failed to start (int("x")) or saw CUDA_VISIBLE_DEVICES=-1
        ('[[engines]]\ndevice = "cuda:x"\n', "engines.device must be"),
        ('[[engines]]\ndevice = "cuda:-1"\n', "engines.device must be"),
        ('[[engines]]\ndevice = "cuda"\ndevice_ids = [-1]\n', "device_ids must be >= 0"),
    ],
)
def test_router_config_errors(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=message):
        load_router_config(path, env={})


def test_a_remote_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    from yaied.router.remote import RemoteHandle

    monkeypatch.setenv("REMOTE_KEY", "k-env")
    url = "http://10.0.0.2:8000"
    assert EngineEntry(kind="remote", url=url, api_key_env="REMOTE_KEY").key == "k-env"
    (tmp_path / "key").write_text("# the key of 10.0.0.2\n\nk-file\n")
    entry = EngineEntry(kind="remote", url=url, api_key_file=str(tmp_path / "key"))
    assert entry.key == "k-file" and "k-file" not in repr(entry)
    assert RemoteHandle("0", entry, RouterConfig()).api_key == "k-file"
    assert "k-toml" not in repr(EngineEntry(kind="remote", url=url, api_key="k-toml"))
    monkeypatch.delenv("REMOTE_KEY")
    with pytest.raises(ValueError, match=r"\$REMOTE_KEY is not set"):
        EngineEntry(kind="remote", url=url, api_key_env="REMOTE_KEY")
    with pytest.raises(ValueError, match="api_key_file .*No such file"):
        EngineEntry(kind="remote", url=url, api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="one of api_key, api_key_file"):
        EngineEntry(kind="remote", url=url, api_key="k", api_key_file=str(tmp_path / "key"))


def test_shipped_toml_router_section_equals_the_defaults():
    from tests.core.test_config import SHIPPED_TOML

    config, engines = load_router_config(SHIPPED_TOML, env={})
    assert config == RouterConfig() and engines == ()


class MockDaemon:
    """A yaied daemon as httpx sees it; ``up`` switches every answer between 200 and 503."""

    def __init__(self) -> None:
        self.up = True
        self.probes = 0
        self.max_model_len: object = 512  # what /v1/models reports

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            return httpx.Response(503)
        if request.url.path == "/health":
            self.probes += 1
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            card = {"id": "m", "max_model_len": self.max_model_len}
            return httpx.Response(200, json={"data": [card]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text='yaied:num_requests_waiting{engine="0"} 4\n')
        usage = {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}
        body = sse(choice("a", [5], "stop"), {"choices": [], "usage": usage}, "[DONE]")
        return httpx.Response(200, content=body.content)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    import asyncio

    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def run_call(handle, request_id: str, prompt: list[int], session_id: str | None = None):
    """Submit one call to a handle and collect its events (EngineUnavailable if lost)."""
    from yaied.core.stream import EventStream
    from yaied.router.handle import CallSink, EngineUnavailable

    events: EventStream[None] = EventStream()
    lost: list[str] = []
    sink = CallSink(events.sink(None), lost.append)
    handle.submit(request_id, prompt, SamplingParams(), session_id=session_id, priority=0,
                  sink=sink)  # fmt: skip
    out = []
    while not events.done and not lost:
        out += [event for _, event in events.drain()]
        await asyncio.sleep(0.001)
    if lost:
        raise EngineUnavailable(lost[0])
    return out + [event for _, event in events.drain()]


@pytest.mark.timeout(20)
async def test_a_remote_engine_goes_down_is_probed_and_comes_back():
    from yaied.router.handle import EngineUnavailable, Health
    from yaied.router.remote import RemoteHandle

    daemon = MockDaemon()
    config = RouterConfig(health_check_interval_seconds=0.01)
    entry = EngineEntry(kind="remote", url="http://remote:8000")
    handle = RemoteHandle("2", entry, config, transport=httpx.MockTransport(daemon))
    lost: list[str] = []
    handle.on_lost = lost.append
    await handle.start()
    assert handle.health is Health.UP and handle.info.max_model_len == 512
    assert handle.stats()["num_requests_waiting"] == 4
    events = await run_call(handle, "r", [1, 2], session_id="s")
    assert events[-1].finish_reason is FinishReason.STOP and events[-1].num_cached_tokens == 1
    daemon.up = False
    await wait_until(lambda: handle.health is Health.DOWN)
    assert lost == ["2"] and handle.stats() is None
    with pytest.raises(EngineUnavailable):
        await run_call(handle, "x", [1])
    daemon.up = True
    probes = daemon.probes
    await wait_until(lambda: handle.health is Health.UP)
    assert daemon.probes >= probes + 2  # two good probes in a row before it is trusted again
    await handle.stop()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("reported", [-4096, 0, 0.5, True, "many", 1 << 40, None])
async def test_a_remote_reporting_no_usable_context_length_is_down_saying_why(reported, caplog):
    """Its limit would be the router's: a remote whose /v1/models says something no context
    length is stays down (one log line, the reason in GET /v1/engines) until it says one."""
    from yaied.router.handle import Health
    from yaied.router.remote import RemoteHandle

    daemon = MockDaemon()
    daemon.max_model_len = reported
    config = RouterConfig(health_check_interval_seconds=0.01)
    entry = EngineEntry(kind="remote", url="http://remote:8000")
    handle = RemoteHandle("2", entry, config, transport=httpx.MockTransport(daemon))
    await handle.start()
    probes = daemon.probes
    await wait_until(lambda: daemon.probes >= probes + 5)
    assert handle.health is Health.DOWN and (handle.info is None or handle.info.max_model_len > 0)
    lines = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(lines) == 1 and repr(reported) in lines[0] and "\n" not in lines[0], lines
    assert "max_model_len" in handle.describe()["error"]
    daemon.max_model_len = 4096
    await wait_until(lambda: handle.health is Health.UP)
    assert handle.info.max_model_len == 4096 and "error" not in handle.describe()
    await handle.stop()


@pytest.mark.timeout(20)
async def test_a_remote_context_length_is_read_again_at_every_probe():
    """A remote daemon is a pool itself (or restarts with another config): what it holds
    changes, and the router's routing follows it."""
    from yaied.router.remote import RemoteHandle

    daemon = MockDaemon()
    config = RouterConfig(health_check_interval_seconds=0.01)
    entry = EngineEntry(kind="remote", url="http://remote:8000")
    handle = RemoteHandle("2", entry, config, transport=httpx.MockTransport(daemon))
    await handle.start()
    assert handle.info.max_model_len == 512
    daemon.max_model_len = 2048
    await wait_until(lambda: handle.info.max_model_len == 2048)
    await handle.stop()
