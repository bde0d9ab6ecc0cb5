"""A client's ids through a remote engine: a non-ASCII `user` (OpenAI accepts any string) reaches
the remote daemon as a header-safe session id, and the call works end to end."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import engine_loader, start_server, stop_server
from yaied.core.config import load_config
from yaied.core.ids import header_safe
from yaied.router.build import build_manager
from yaied.router.config import EngineEntry, RouterConfig
from yaied.server.config import ServerConfig

USER = "Jürgen 🚀 ユーザー\r\nX-Injected: 1"


@pytest.mark.timeout(120)
def test_non_ascii_user_through_a_remote_engine(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    remote = start_server(ServerConfig(), engine_loader(model=model, threads=1), "tiny")
    engine_config = load_config(env={}, overrides={"model": model, "kv_cache_gib": 0.01})
    entries = (EngineEntry(kind="remote", url=remote.url),)
    try:
        router = start_server(
            ServerConfig(served_model_name="tiny"),
            lambda: build_manager(engine_config, RouterConfig(), entries),
            "tiny",
        )
        try:
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "user": USER, "ignore_eos": True}
            r = httpx.post(router.v1 + "/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            lifecycle = remote.server.config.app.state.server.manager.lifecycle
            assert len(lifecycle.by_session(header_safe(USER))) == 1  # one session, encoded
        finally:
            stop_server(router)
    finally:
        stop_server(remote)
