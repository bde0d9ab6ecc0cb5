"""Schemathesis against our /openapi.json: valid and invalid requests generated from the schema,
sent in-process (no socket) to the app on a tiny model. No 5xx, and every error an OpenAI error
body.

The schema is built from the same function the server serves it with (checked below), so the
test cases exist at collection time while the app starts in a fixture.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from starlette.testclient import TestClient

from tests.server.conftest import engine_loader, in_process_server
from tests.server.test_fuzz import assert_error_body
from yaied.server.app import VERSION
from yaied.server.config import ServerConfig
from yaied.server.openapi import openapi_schema

schemathesis = pytest.importorskip("schemathesis")

SCHEMA = schemathesis.openapi.from_dict(openapi_schema(VERSION))


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    # Tight limits keep generated "valid" requests (n up to anything, max_tokens up to the
    # context) short, and exercise the limit errors themselves.
    config = ServerConfig(served_model_name="tiny", max_tokens_limit=8, max_n=4)
    loader = engine_loader(model=str(tiny_model_dirs["llama"]), max_model_len=0, threads=1)
    with in_process_server(config, loader, "ignored") as client:
        yield client


def send(client: TestClient, case: Any) -> httpx.Response:
    """The case's request through the in-process client. Schemathesis describes it as keyword
    arguments for `requests`; the two differ in a raw body (`data` there, `content` here) and in
    cookies (per request there, a header here)."""
    kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
    headers = dict(kwargs.pop("headers"))
    if cookies := kwargs.pop("cookies", None):
        headers["Cookie"] = "; ".join(f"{name}={value}" for name, value in cookies.items())
    if isinstance(kwargs.get("data"), str | bytes):
        kwargs["content"] = kwargs.pop("data")
    return client.request(headers=headers, **kwargs)


def test_served_schema_is_the_one_tested(tiny):
    assert tiny.get("/openapi.json").json() == openapi_schema(VERSION)


@pytest.mark.timeout(120)
@SCHEMA.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_generated_requests_never_get_a_5xx(case, tiny):
    response = send(tiny, case)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    assert_error_body(response, case.path)
