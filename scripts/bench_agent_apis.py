"""Issue 33's targets, measured over HTTP on the default model (the daemon's app in this process,
uvicorn on a loopback port):

1. Responses chains: TTFT of turn N of a ``previous_response_id`` chain against turn 1's for the
   same number of new (uncached) prompt tokens, and the cached-token share of turns 2+. Turn 1's
   TTFT as a function of its prompt length is fitted (least squares, a line) from fresh
   requests of several sizes; each later turn is compared with the fit at its own new-token
   count (its input tokens minus the cached ones). Each turn is also compared with a fresh
   request of the same word count sent just before it (``paired_ratio``, the median over the
   chains): that ratio does not move with the machine's speed over the run, as the fit, taken
   once at the start, does. TTFT: from sending the request to the first
   ``response.output_text.delta`` (or output item) of the stream.
2. Embeddings: 256 short inputs in one request against the same inputs one request each, in
   pairs close in time (``embeddings`` below); the figure is the median of the pairs' ratios.

    PYTHONPATH=. nice -n 19 .venv/bin/python scripts/bench_agent_apis.py --port 18133

Prints one JSON line per measurement and a summary line; record the figures with ``lscpu``'s
model name and the kernel ISA level /health reports.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any

import httpx
import uvicorn

WORDS = [
    *("apple", "river", "stone", "cloud", "market", "engine", "garden", "silver", "window"),
    *("planet", "letter", "music", "forest", "candle", "bridge", "harbor", "pencil", "winter"),
    *("summer", "coffee", "island", "mirror", "rocket", "thunder", "valley"),
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def serve(port: int, threads: int) -> tuple[uvicorn.Server, threading.Thread]:
    from yaied.core.config import load_config
    from yaied.engine.async_engine import AsyncEngine
    from yaied.server.app import build_app
    from yaied.server.config import ServerConfig

    def load() -> AsyncEngine:
        overrides: dict[str, Any] = {"max_model_len": 4096}
        if threads:
            overrides["threads"] = threads
        return AsyncEngine(load_config(env={}, overrides=overrides), show_progress=False)

    app = build_app(ServerConfig(port=port), load, "default")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server, thread
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def streamed_turn(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(TTFT seconds, the completed response)."""
    start = time.perf_counter()
    ttft, final = None, None
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event["type"]
            first = kind.endswith(".delta") or kind == "response.output_item.added"
            if ttft is None and first:
                ttft = time.perf_counter() - start
            if kind in ("response.completed", "response.incomplete"):
                final = event["response"]
    assert ttft is not None and final is not None
    return ttft, final


def cached_tokens(response: dict[str, Any]) -> int:
    return response["usage"]["input_tokens_details"]["cached_tokens"]


def chains(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    base = {"model": "default", "max_output_tokens": args.output_tokens, "temperature": 0}
    for _ in range(3):  # warm-up: first-call costs (kernels, allocator) are not turn 1's
        streamed_turn(client, {**base, "input": words(rng, 50), "store": False})
    # Turn 1 at several sizes, cold (random words: nothing in common with the cache).
    fit_points = []
    for size in sorted(args.turn1_words):
        for _ in range(args.reps):
            ttft, final = streamed_turn(client, {**base, "input": words(rng, size), "store": False})
            new = final["usage"]["input_tokens"] - cached_tokens(final)
            fit_points.append((new, ttft))
            print(json.dumps({"kind": "turn1", "new_tokens": new, "ttft_s": round(ttft, 4)}))
    # The machine may be shared: medians per size (then a line through them) and per turn
    # (over the chains) keep a stray slow step from deciding the figure.
    by_size: dict[int, list[tuple[int, float]]] = {}
    for size, point in zip(sorted(args.turn1_words * args.reps), fit_points, strict=True):
        by_size.setdefault(size, []).append(point)
    xs = [statistics.median(p[0] for p in points) for points in by_size.values()]
    ys = [statistics.median(p[1] for p in points) for points in by_size.values()]
    slope, intercept = statistics.linear_regression(xs, ys)
    turns: dict[int, list[tuple[int, int, float]]] = {}
    paired: dict[int, list[float]] = {}
    control_rng = random.Random(2)  # its own words: the chains' inputs stay those of earlier runs
    for chain in range(args.reps):
        previous = None
        for turn in range(1, args.turns + 1):
            # A fresh request of the turn's size just before it: the machine's speed drifts
            # over a run, and a ratio to a neighbour does not move with it (the fit's slope
            # makes up the few tokens by which their new-token counts differ).
            control_s, control = streamed_turn(
                client, {**base, "input": words(control_rng, args.turn_words), "store": False}
            )
            control_new = control["usage"]["input_tokens"] - cached_tokens(control)
            body = {**base, "input": words(rng, args.turn_words)}
            if previous is not None:
                body["previous_response_id"] = previous
            ttft, final = streamed_turn(client, body)
            previous = final["id"]
            usage = final["usage"]
            cached = cached_tokens(final)
            new = usage["input_tokens"] - cached
            turns.setdefault(turn, []).append((usage["input_tokens"], cached, ttft))
            paired.setdefault(turn, []).append(ttft / (control_s + slope * (new - control_new)))
            row = {"kind": "chain", "chain": chain, "turn": turn, "input_tokens":
                   usage["input_tokens"], "cached_tokens": cached, "new_tokens": new,
                   "ttft_s": round(ttft, 4), "control_ttft_s": round(control_s, 4),
                   "control_new_tokens": control_new}  # fmt: skip
            print(json.dumps(row))
    per_turn = []
    for turn, rows in turns.items():
        prompt = statistics.median(r[0] for r in rows)
        cached = statistics.median(r[1] for r in rows)
        ttft = statistics.median(r[2] for r in rows)
        fit = intercept + slope * (prompt - cached)
        per_turn.append({"turn": turn, "input_tokens": prompt, "cached_tokens": cached,
                         "new_tokens": prompt - cached, "ttft_s": round(ttft, 4),
                         "turn1_fit_s": round(fit, 4), "ratio": round(ttft / fit, 3),
                         "paired_ratio": round(statistics.median(paired[turn]), 3),
                         "cached_share": round(cached / prompt, 3)})  # fmt: skip
    later = [row for row in per_turn if row["turn"] >= 2]
    return {
        "turn1_fit": {"intercept_s": round(intercept, 4), "s_per_token": round(slope, 6)},
        "per_turn": per_turn,
        "cached_share_turn2plus_mean": round(statistics.fmean(r["cached_share"] for r in later), 3),
    }


def embeddings(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    """The batched request of every input against the same inputs one by one, in pairs close in
    time: each pair is one batched request and one slice of the inputs called one at a time
    (slices in turn, so that every input is called alone once over the run), in alternating
    order. On a shared machine whose speed moves by minutes, a ratio of two figures taken a
    minute apart says more about the machine than about the path: each pair's ratio is taken
    within a few seconds, and their median is the figure."""
    rng = random.Random(1)
    inputs = [f"Item {i}: {words(rng, 6)}." for i in range(args.num_inputs)]
    size = max(1, args.num_inputs // args.pairs)
    batched_rates, single_rates, ratios = [], [], []
    for pair in range(args.pairs):
        first = (pair * size) % args.num_inputs
        part = inputs[first : first + size]
        # alternate which goes first, so that neither always runs on a warmer machine
        if pair % 2:
            single_rates.append(_inputs_per_s(client, part, one_by_one=True))
            batched_rates.append(_inputs_per_s(client, inputs, one_by_one=False))
        else:
            batched_rates.append(_inputs_per_s(client, inputs, one_by_one=False))
            single_rates.append(_inputs_per_s(client, part, one_by_one=True))
        ratios.append(batched_rates[-1] / single_rates[-1])
        print(json.dumps({"kind": "embeddings", "batched_inputs_per_s": round(batched_rates[-1], 1),
                          "one_by_one_inputs_per_s": round(single_rates[-1], 1),
                          "ratio": round(ratios[-1], 2)}))  # fmt: skip
    tokens = client.post("/v1/embeddings", json={"input": inputs}).json()["usage"]["prompt_tokens"]
    return {
        "inputs": args.num_inputs,
        "prompt_tokens": tokens,
        "batched_inputs_per_s": round(statistics.median(batched_rates), 1),
        "one_by_one_inputs_per_s": round(statistics.median(single_rates), 1),
        "speedup_paired_median": round(statistics.median(ratios), 2),
        "speedup_paired_range": [round(min(ratios), 2), round(max(ratios), 2)],
        # the unpaired ratio of the medians, as earlier versions of this script printed it
        "speedup_of_medians": round(
            statistics.median(batched_rates) / statistics.median(single_rates), 2
        ),
    }


def _inputs_per_s(client: httpx.Client, inputs: list[str], *, one_by_one: bool) -> float:
    """Embeddings of ``inputs`` in one request, or one request each: inputs a second."""
    start = time.perf_counter()
    for body in [{"input": text} for text in inputs] if one_by_one else [{"input": inputs}]:
        client.post("/v1/embeddings", json=body).raise_for_status()
    return len(inputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=18133)
    parser.add_argument("--threads", type=int, default=0, help="engine threads; 0: its default")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-words", type=int, default=60, help="new words per later turn")
    parser.add_argument("--turn1-words", type=int, nargs="+", default=[40, 60, 80, 110, 140])
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3, help="chains, and turn-1 fit points")
    parser.add_argument("--pairs", type=int, default=8, help="embeddings: batched/one-by-one pairs")
    parser.add_argument("--only", choices=("chains", "embeddings"), help="one of the two parts")
    args = parser.parse_args()
    server, thread = serve(args.port, args.threads)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600) as client:
            health = client.get("/health").json()
            summary: dict[str, Any] = {"health": health}
            if args.only != "embeddings":
                summary["chains"] = chains(client, args)
            if args.only != "chains":
                summary["embeddings"] = embeddings(client, args)
        print(json.dumps({"kind": "summary", **summary}))
    finally:
        server.should_exit = True
        thread.join(timeout=60)


if __name__ == "__main__":
    main()
