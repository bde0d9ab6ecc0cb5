"""Crowd parity over HTTP: every request answers in a crowd what it answers alone.

    .venv/bin/python scripts/stress_crowd.py --url http://127.0.0.1:8000 --requests 32

Point it at a running daemon with a deliberately small KV pool, so that a crowd sharing long
prefixes preempts and evicts often, for instance:

    yaied serve --dtype float32 --batch-invariant --max-model-len 2048 --kv-cache-gib 0.12

It builds ``--requests`` requests over a few long system prompts (300-1500 tokens) that mix
greedy and seeded sampling (temperature, top_p, top_k, min_p), penalties, logit_bias, stop
strings cut from the request's own output (so they span tokens), n > 1, logprobs and
top_logprobs, echo, json_schema response formats, tools with tool_choice required or named and
completions whose max_tokens reaches the context's end. Each is run alone on the idle daemon
first; then all of them at once, streaming or not, beside clients that leave mid-stream or
cancel through the API. Checks:

- every deterministic request (greedy, or seeded) gives the alone run's choices: text, tool
  calls, finish reasons, logprob tokens; logprob values within ``--logprob-tolerance`` (0, the
  default, asks for the same bits: run the daemon with --batch-invariant);
- a request with a stop string ends where its stop-less twin's text first shows it;
- structured outputs parse (and hold their schema's required keys), tool calls name the tool;
- no 5xx, every stream ends (``data: [DONE]``) within ``--timeout`` seconds;
- afterwards nothing runs or waits and every KV page is free or held by the prefix cache
  (``kv_cache_usage_perc`` 0 on /metrics).

One JSON summary goes to stdout; the exit code is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_WORD_TEXT = (
    "river stone lantern harbor quiet market thunder velvet orchard compass meadow signal "
    "granite whisper copper ladder voyage ember canyon mirror ribbon falcon glacier pocket "
    "saddle timber violet anchor beacon cobalt drift fable harvest island jigsaw kettle"
)
_WORDS = _WORD_TEXT.split()


def system_prompt(rng: random.Random, words: int) -> str:
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        n = rng.randint(6, 14)
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + ".")
    return "You are a patient assistant. Background notes: " + " ".join(sentences)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Spec:
    name: str
    path: str
    body: dict[str, Any]
    deterministic: bool = True
    kind: str = "plain"  # plain | json | tool | stop (derived from a twin) | leave
    twin: str | None = None  # stop: the spec whose text the stop string is cut from
    leave_after: int = 0  # leave: data lines read before the client goes
    api_cancel: bool = False  # leave: cancel through the API instead of closing


@dataclass
class Result:
    status: int
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0


def _choice(entry: dict[int, dict[str, Any]], index: int) -> dict[str, Any]:
    return entry.setdefault(
        index, {"text": "", "tools": {}, "lp": [], "finish": None, "prompt_lp": None}
    )


def _chat_logprobs(lp: dict | None) -> list:
    if not lp or not lp.get("content"):
        return []
    return [
        (t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t.get("top_logprobs", [])])
        for t in lp["content"]
    ]


def _completion_logprobs(lp: dict | None) -> list:
    if not lp or not lp.get("tokens"):
        return []
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return [
        (tok, val, sorted((top or {}).items()))
        for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], tops, strict=True)
    ]


def absorb(choices: dict[int, dict[str, Any]], item: dict[str, Any], chat: bool) -> None:
    """One choice of a body or of a chunk, into the canonical record."""
    c = _choice(choices, item["index"])
    if chat:
        part = item.get("delta") or item.get("message") or {}
        c["text"] += part.get("content") or ""
        for k, call in enumerate(part.get("tool_calls") or []):
            slot = c["tools"].setdefault(call.get("index", k), {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
        c["lp"] += _chat_logprobs(item.get("logprobs"))
    else:
        c["text"] += item.get("text") or ""
        c["lp"] += _completion_logprobs(item.get("logprobs"))
    if item.get("finish_reason"):
        c["finish"] = item["finish_reason"]


async def send(client: httpx.AsyncClient, base: str, spec: Spec, stream: bool) -> Result:
    chat = spec.path.endswith("chat/completions")
    body = dict(spec.body, stream=stream)
    start = time.monotonic()
    if not stream:
        r = await client.post(base + spec.path, json=body)
        result = Result(r.status_code, seconds=time.monotonic() - start)
        if r.status_code != 200:
            result.error = r.text[:300]
            return result
        for item in r.json()["choices"]:
            absorb(result.choices, item, chat)
        return result
    headers = {"X-Request-Id": f"stress-{spec.name}-{random.random()}"}
    async with client.stream("POST", base + spec.path, json=body, headers=headers) as r:
        result = Result(r.status_code)
        if r.status_code != 200:
            result.error = (await r.aread()).decode()[:300]
            return result
        lines = 0
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            lines += 1
            if spec.kind == "leave" and lines >= spec.leave_after:
                if spec.api_cancel:
                    rid = headers["X-Request-Id"]
                    await client.post(f"{base}/v1/requests/{rid}/cancel")
                    spec = Spec(spec.name, spec.path, spec.body, kind="plain")  # read to the end
                else:
                    result.error = "left"
                    return result
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"error chunk: {chunk['error']}"
                continue
            for item in chunk.get("choices", []):
                absorb(result.choices, item, chat)
        if not done:
            result.error = result.error or "no [DONE]"
    result.seconds = time.monotonic() - start
    return result


def build_specs(rng: random.Random, count: int, systems: list[str], room: int) -> list[Spec]:
    """``room``: the context's tokens (max_model_len), for the requests that fill it."""
    specs: list[Spec] = []
    questions = [
        "Summarise the notes in one sentence.",
        "Which word appears most often?",
        "Write a short poem about the harbor.",
        "List three items from the notes.",
        "What would a falcon say about the glacier?",
    ]
    for i in range(count):
        system = systems[i % len(systems)]
        question = rng.choice(questions) + f" (#{i})"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        kind = i % 10
        name = f"r{i}"
        if kind == 0:  # greedy chat, logprobs
            body = {
                "messages": messages,
                "max_tokens": rng.randint(12, 32),
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 3,
            }
            specs.append(Spec(name, "/v1/chat/completions", body))
        elif kind == 1:  # seeded sampling, n > 1
            body = {
                "messages": messages,
                "max_tokens": rng.randint(12, 32),
                "temperature": 0.9,
                "top_p": 0.9,
                "top_k": 40,
                "min_p": 0.05,
                "seed": rng.randint(0, 9999),
                "n": rng.choice([1, 2, 3]),
                "logprobs": True,
                "top_logprobs": 2,
            }
            specs.append(Spec(name, "/v1/chat/completions", body))
        elif kind == 2:  # penalties, completions, logprobs
            body = {
                "prompt": system + "\n" + question,
                "max_tokens": rng.randint(12, 32),
                "temperature": 0,
                "presence_penalty": 0.6,
                "frequency_penalty": 0.4,
                "repetition_penalty": 1.15,
                "logprobs": 2,
            }
            specs.append(Spec(name, "/v1/completions", body))
        elif kind == 3:  # logit_bias, seeded
            body = {
                "messages": messages,
                "max_tokens": rng.randint(12, 24),
                "temperature": 0.7,
                "seed": rng.randint(0, 9999),
                "logit_bias": {"13": 4, "28": -100},
            }
            specs.append(Spec(name, "/v1/chat/completions", body))
        elif kind == 4:  # a stop string cut from a twin's output
            body = {"messages": messages, "max_tokens": 32, "temperature": 0}
            specs.append(Spec(name + "t", "/v1/chat/completions", body))
            specs.append(
                Spec(name, "/v1/chat/completions", dict(body), kind="stop", twin=name + "t")
            )
        elif kind == 5:  # json_schema
            body = {
                "messages": messages[:1] + [{"role": "user", "content": "Describe a person."}],
                "max_tokens": 80,
                "temperature": rng.choice([0, 0.8]),
                "seed": i,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
                },
            }
            specs.append(Spec(name, "/v1/chat/completions", body, kind="json"))
        elif kind == 6:  # tools, required or named
            choice = rng.choice(
                ["required", {"type": "function", "function": {"name": "get_time"}}]
            )
            body = {
                "messages": messages[:1] + [{"role": "user", "content": "Weather in Oslo?"}],
                "max_tokens": 60,
                "temperature": rng.choice([0, 0.8]),
                "seed": i,
                "tools": [WEATHER_TOOL, TIME_TOOL],
                "tool_choice": choice,
            }
            specs.append(Spec(name, "/v1/chat/completions", body, kind="tool"))
        elif kind == 7:  # echo with prompt logprobs
            body = {
                "prompt": system[: rng.randint(200, 600)],
                "max_tokens": rng.choice([0, 4]),
                "echo": True,
                "logprobs": 1,
                "temperature": 0,
            }
            specs.append(Spec(name, "/v1/completions", body))
        elif kind == 8:  # to the context's end: filled in by fill_to_end
            body = {
                "prompt": system + "\n" + question,
                "temperature": 0,
                "ignore_eos": True,
                "max_tokens": 16,
            }
            specs.append(Spec(name, "/v1/completions", body, kind="end"))
        else:  # unseeded sampling (no parity) streaming
            body = {"messages": messages, "max_tokens": 24, "temperature": 1.0}
            specs.append(Spec(name, "/v1/chat/completions", body, deterministic=False))
    return specs


async def fill_to_end(client: httpx.AsyncClient, base: str, specs: list[Spec], room: int) -> None:
    """Give each "end" spec a prompt of token ids that leaves 4-20 tokens of the context, and
    a max_tokens that takes exactly those."""
    rng = random.Random(len(specs))
    for spec in specs:
        if spec.kind != "end":
            continue
        r = await client.post(base + "/tokenize", json={"prompt": spec.body["prompt"]})
        ids = r.json()["tokens"]
        left = rng.randint(4, 20)
        spec.body["prompt"] = (ids * (room // len(ids) + 1))[: room - left]
        spec.body["max_tokens"] = left
        spec.kind = "plain"


def derive_stop(spec: Spec, twin: Result) -> bool:
    """Cut a stop string of 3-7 characters out of the middle of the twin's text."""
    text = twin.choices[0]["text"] if twin.choices else ""
    if len(text) < 12:
        return False
    start = len(text) // 2
    stop = text[start : start + 7].strip() or text[start : start + 7]
    spec.body["stop"] = [stop]
    spec.body.setdefault("include_stop_str_in_output", False)
    return True


def compare(spec: Spec, alone: Result, crowd: Result, tol: float) -> list[str]:
    problems = []
    if set(alone.choices) != set(crowd.choices):
        return [f"choices {sorted(alone.choices)} alone, {sorted(crowd.choices)} in the crowd"]
    for k in sorted(alone.choices):
        a, c = alone.choices[k], crowd.choices[k]
        for key in ("text", "tools", "finish"):
            if a[key] != c[key]:
                problems.append(f"choice {k} {key}: alone {a[key]!r}, crowd {c[key]!r}")
        if [x[0] for x in a["lp"]] != [x[0] for x in c["lp"]]:
            problems.append(f"choice {k} logprob tokens differ")
            continue
        worst = 0.0
        for x, y in zip(a["lp"], c["lp"], strict=True):
            if x[1] is not None and y[1] is not None:
                worst = max(worst, abs(x[1] - y[1]))
            if [t for t, _ in x[2]] != [t for t, _ in y[2]] and tol == 0:
                problems.append(f"choice {k} top_logprobs tokens differ at {x[0]!r}")
                break
            for (_, u), (_, v) in zip(x[2], y[2], strict=False):
                if u is not None and v is not None:
                    worst = max(worst, abs(u - v))
        if worst > tol:
            problems.append(f"choice {k} logprobs differ by {worst:.3g}")
    return problems


def validate(spec: Spec, result: Result) -> list[str]:
    problems = []
    for k, c in result.choices.items():
        if spec.kind == "json" and c["finish"] == "stop":
            try:
                value = json.loads(c["text"])
            except ValueError:
                problems.append(f"choice {k}: not JSON: {c['text'][:120]!r}")
                continue
            missing = [key for key in PERSON_SCHEMA["required"] if key not in value]
            if missing or set(value) - set(PERSON_SCHEMA["properties"]):
                problems.append(f"choice {k}: {value} breaks the schema")
        if spec.kind == "tool" and c["finish"] == "tool_calls":
            for call in c["tools"].values():
                choice = spec.body["tool_choice"]
                if isinstance(choice, dict) and call["name"] != choice["function"]["name"]:
                    problems.append(f"choice {k}: called {call['name']}, asked {choice}")
                try:
                    json.loads(call["arguments"])
                except ValueError:
                    problems.append(f"choice {k}: arguments not JSON: {call['arguments']!r}")
        if spec.kind == "tool" and c["finish"] == "stop":
            problems.append(f"choice {k}: tool_choice {spec.body['tool_choice']} but no call")
        stop = spec.body.get("stop")
        if stop and c["finish"] == "stop" and stop[0] in c["text"]:
            problems.append(f"choice {k}: stop string {spec.body['stop'][0]!r} in the text")
    return problems


async def metrics(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    text = (await client.get(base + "/metrics")).text
    out = {}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prefix_cache_hits_total",
    ):
        m = re.search(rf"^yaied:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    base = args.url.rstrip("/")
    failures: list[str] = []
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=args.requests * 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        room = (await client.post(base + "/tokenize", json={"prompt": "x"})).json()["max_model_len"]
        systems = [system_prompt(rng, w) for w in args.system_words]
        specs = build_specs(rng, args.requests, systems, room)
        await fill_to_end(client, base, specs, room)
        by_name = {s.name: s for s in specs}
        alone: dict[str, Result] = {}
        t0 = time.monotonic()
        for spec in specs if not args.crowd_only else ():  # alone, twins before their stops
            if spec.kind == "stop" and not derive_stop(spec, alone[spec.twin]):
                spec.kind = "plain"
                spec.body["stop"] = None
            alone[spec.name] = await send(client, base, spec, stream=False)
            if alone[spec.name].status != 200:
                failures.append(
                    f"{spec.name} alone: {alone[spec.name].status} {alone[spec.name].error}"
                )
        alone_s = time.monotonic() - t0
        for spec in specs if not args.crowd_only else ():
            if spec.kind == "stop":
                twin = alone[spec.twin].choices[0]["text"]
                stop = spec.body["stop"][0]
                want = twin[: twin.find(stop)]
                got = alone[spec.name].choices[0]["text"]
                if got != want:
                    failures.append(f"{spec.name}: stop {stop!r} gave {got!r}, want {want!r}")
        before = await metrics(client, base)

        leavers = [
            Spec(
                f"x{i}",
                "/v1/chat/completions",
                {
                    "messages": [
                        {"role": "system", "content": systems[i % len(systems)]},
                        {"role": "user", "content": f"Tell a long story {i}."},
                    ],
                    "max_tokens": 200,
                    "temperature": 0.8,
                },
                kind="leave",
                leave_after=rng.randint(1, 6),
                api_cancel=i % 3 == 0,
            )
            for i in range(args.leavers)
        ]
        crowd_specs = specs + leavers
        rng.shuffle(crowd_specs)

        async def one(spec: Spec) -> tuple[Spec, Result | None]:
            await asyncio.sleep(rng.random() * args.spread)
            try:
                stream = spec.kind == "leave" or rng.random() < 0.6  # leavers read a stream
                res = await asyncio.wait_for(send(client, base, spec, stream), args.timeout)
            except TimeoutError:
                return spec, None
            return spec, res

        t0 = time.monotonic()
        done = await asyncio.gather(*(one(s) for s in crowd_specs))
        crowd_s = time.monotonic() - t0
        compared = 0
        for spec, res in done:
            if res is None:
                failures.append(f"{spec.name}: hung (no end within {args.timeout}s)")
                continue
            if res.status >= 500 or (res.error and res.error != "left"):
                failures.append(f"{spec.name}: {res.status} {res.error}")
                continue
            if spec.kind == "leave":
                continue
            failures += [f"{spec.name}: {p}" for p in validate(spec, res)]
            if spec.deterministic and spec.name in alone:
                compared += 1
                failures += [
                    f"{spec.name} ({json.dumps(by_name[spec.name].body)[-160:]}): {p}"
                    for p in compare(spec, alone[spec.name], res, args.logprob_tolerance)
                ]
        for _ in range(50):  # the leavers' aborts land at the next step
            after = await metrics(client, base)
            if not after.get("num_requests_running") and not after.get("num_requests_waiting"):
                break
            await asyncio.sleep(0.2)
        if after.get("num_requests_running") or after.get("num_requests_waiting"):
            failures.append(f"not idle after the load: {after}")
        if after.get("kv_cache_usage_perc"):
            failures.append(f"KV pages still held after the load: {after}")
    return {
        "requests": len(specs),
        "leavers": len(leavers),
        "compared": compared,
        "alone_seconds": round(alone_s, 1),
        "crowd_seconds": round(crowd_s, 1),
        "preemptions": after.get("num_preemptions_total", 0)
        - before.get("num_preemptions_total", 0),
        "metrics_after": after,
        "failures": failures,
        "ok": not failures,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--leavers", type=int, default=8, help="clients that leave mid-stream")
    parser.add_argument("--system-words", type=int, nargs="+", default=[250, 600, 1100])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spread", type=float, default=2.0, help="arrivals over this many s")
    parser.add_argument("--timeout", type=float, default=600.0, help="a request's bound, s")
    parser.add_argument(
        "--crowd-only", action="store_true", help="skip the alone runs (no parity checks)"
    )
    parser.add_argument("--logprob-tolerance", type=float, default=0.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    summary = asyncio.run(main_async(parse_args(argv)))
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
