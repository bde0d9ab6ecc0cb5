"""``POST /v1/embeddings``: the served model's pooled final hidden states, OpenAI's shape.

Each input is one engine call with ``SamplingParams.pooling`` (core/request.py): it prefills in
the engine's normal batches beside everything else (so a list of inputs runs together, a step
at a time, not one after another), returns its pooled vector in its one event, decodes nothing
and gives its pages back at once. Pooling: ``mean`` over every prompt position (the default: a
causal model's last position sees the whole text but is trained to predict the next token,
the mean is the steadier summary) or ``last`` (yaied's ``pooling`` field); the vector is
L2-normalised here. ``encoding_format`` float or base64 (little-endian float32, as OpenAI's);
``dimensions`` is refused: the model's hidden size is the only one.
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from yaied.core.request import FinishReason, SamplingParams
from yaied.router.manager import EngineManager
from yaied.server.agent_run import ClientGone, collect_events
from yaied.server.auth import api_key_of
from yaied.server.body import read_json
from yaied.server.errors import APIError, from_value_error, json_response, public_error
from yaied.server.keys import scoped_id
from yaied.server.limits import RequestLimits, check_client_ids
from yaied.server.protocol import _get, _refuse_unknown_fields, parse_prompts
from yaied.server.serving import Job, request_key, submit_jobs
from yaied.server.state import ServerState

EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "pooling"})
_POOLING = ("mean", "last")
_FORMATS = ("float", "base64")


def routes() -> list[Route]:
    return [Route("/v1/embeddings", create_embeddings, methods=["POST"])]


def _parse(body: dict[str, Any]) -> tuple[list[str | list[int]], str, str]:
    _refuse_unknown_fields(body, EMBEDDING_FIELDS)
    if body.get("dimensions") is not None:
        text = "dimensions is not supported: embeddings have the model's hidden size"
        raise APIError(400, text, param="dimensions")
    fmt = _get(body, "encoding_format", (str,), "float")
    if fmt not in _FORMATS:
        raise APIError(400, "encoding_format must be float or base64", param="encoding_format")
    pooling = _get(body, "pooling", (str,), "mean")
    if pooling not in _POOLING:
        raise APIError(400, "pooling must be mean or last", param="pooling")
    _get(body, "user", (str,))
    check_client_ids(body)
    try:
        inputs = parse_prompts(body.get("input"))
    except APIError as exc:
        raise APIError(400, exc.message.replace("prompt", "input"), param="input") from None
    if any(isinstance(item, str) and not item for item in inputs):
        raise APIError(400, "input strings must not be empty", param="input")
    return inputs, fmt, pooling


def _jobs(
    manager: EngineManager,
    inputs: list[str | list[int]],
    pooling: str,
    key: str,
    limits: RequestLimits,
) -> list[Job]:
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    jobs = []
    try:
        for index, item in enumerate(inputs):
            ids = manager.inputs.prompt_token_ids(item, params)
            limits.check_prompt(len(ids), "input")
            request_id = key if len(inputs) == 1 else f"{key}-{index}"
            jobs.append(Job(index, index, request_id, ids, "", params))
    except ValueError as exc:
        error = from_value_error(exc, {"prompt": "input"})
        error.message = error.message.replace("prompt (", "input (", 1)  # the API's word
        raise error from None
    return jobs


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    norm = math.sqrt(sum(value * value for value in vector)) or 1.0
    unit = [value / norm for value in vector]
    if fmt == "float":
        return unit
    return base64.b64encode(struct.pack(f"<{len(unit)}f", *unit)).decode("ascii")


async def create_embeddings(request: Request) -> Response:
    server: ServerState = request.state.server
    request_id = request.headers.get("x-request-id") or "embd-" + uuid.uuid4().hex
    request.state.request_id = request_id
    manager = server.ready_manager()
    body = await read_json(request)
    inputs, fmt, pooling = _parse(body)
    server.check_model(_get(body, "model", (str,)))
    limits = RequestLimits.from_config(server.config)
    if len(inputs) > limits.max_jobs:
        text = f"at most {limits.max_jobs} inputs per request, got {len(inputs)}"
        raise APIError(400, text, param="input", code="too_many_inputs")
    size = sum(len(item) for item in inputs)
    key = request_key(request_id)
    jobs = await server.off_loop(size, _jobs, manager, inputs, pooling, key, limits)
    server.check_queue(manager, len(jobs))
    api_key = api_key_of(request)
    started = submit_jobs(
        manager, jobs, server.metrics, client_id=scoped_id(api_key, request_id),
        session_id=None, priority=0,
    )  # fmt: skip
    vectors: dict[int, list[float]] = {}

    def take(job: Job, event: Any) -> None:
        if event.finish_reason is FinishReason.ERROR or event.embedding is None:
            error = event.error or "the engine returned no embedding"
            raise APIError(500, public_error("embedding failed", error, request_id))
        vectors[job.index] = event.embedding

    try:
        await collect_events(request, started, take)
    except ClientGone:
        return Response(status_code=499)
    data = [
        {"object": "embedding", "index": job.index, "embedding": _encode(vectors[job.index], fmt)}
        for job in jobs
    ]
    num_tokens = sum(len(job.prompt_ids) for job in jobs)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    out = {"object": "list", "data": data, "model": server.model_name, "usage": usage}
    return json_response(out, headers={"X-Request-Id": request_id})
