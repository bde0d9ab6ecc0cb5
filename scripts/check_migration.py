"""Calls that outlive their engine, measured: streams open on engine 0 when it is removed or its
process killed, on two CPU engine processes.

    PYTHONPATH=. .venv/bin/python scripts/check_migration.py                  # remove, 8 streams
    PYTHONPATH=. .venv/bin/python scripts/check_migration.py --how kill --streams 16
    PYTHONPATH=. .venv/bin/python scripts/check_migration.py --model /path/to/tiny --dtype float32

The session's first call pins it to engine 0 and is the reference (greedy, ignore_eos). Then
``--streams`` calls of that session stream from engine 0; once each has ``--after`` tokens,
engine 0 is removed (``remove_engine(timeout=--timeout)``) or its process is killed (SIGKILL).
It prints, and writes as one JSON line: the finish reasons, how many streams equal the reference
token for token (expected: all in fp32; in bf16 a recompute may round differently), the moves,
the longest pause a stream saw (the seam: the next engine recomputes prompt and output), and
the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import time

from yaied.core.config import load_config
from yaied.core.request import SamplingParams
from yaied.router.build import build_manager
from yaied.router.config import EngineEntry, RouterConfig
from yaied.worker.model_files import DEFAULT_MODEL_NAME

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


async def read(handle, seen: list[int], gaps: list[float]) -> tuple[str, list[int], str | None]:
    tokens, last = [], time.monotonic()
    async for event in handle:
        now = time.monotonic()
        if event.token_ids:
            gaps.append(now - last)
            last = now
            tokens.extend(event.token_ids)
            seen[0] = len(tokens)
        if event.finished:
            return event.finish_reason.value, tokens, event.error
    raise AssertionError("a stream ended without a final event")


async def main(args: argparse.Namespace) -> dict:
    overrides = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib,
        "max_model_len": 1024,
    }
    config = load_config(env={}, overrides=overrides)
    entries = tuple(EngineEntry(device="cpu", threads=args.threads) for _ in range(2))
    manager = build_manager(config, RouterConfig(long_call_threshold=1), entries)
    await manager.start()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        first = await manager.submit_request(session_id="m", prompt=PROMPT, sampling_params=params)
        reference = (await first.result()).token_ids
        assert first.engine_id == "0", "the session should start on engine 0"
        handles = [
            await manager.submit_request(session_id="m", prompt=PROMPT, sampling_params=params)
            for _ in range(args.streams)
        ]
        assert {h.engine_id for h in handles} == {"0"}
        counts = [[0] for _ in handles]
        gaps: list[list[float]] = [[] for _ in handles]
        readers = [
            asyncio.create_task(read(h, c, g))
            for h, c, g in zip(handles, counts, gaps, strict=True)
        ]
        while any(c[0] < args.after for c in counts):
            await asyncio.sleep(0.01)
        start = time.monotonic()
        if args.how == "kill":
            os.kill(manager.handles["0"].pid, signal.SIGKILL)
        else:
            manager.start_removal("0", args.timeout)
        results = await asyncio.wait_for(asyncio.gather(*readers), args.read_timeout)
        elapsed = time.monotonic() - start
        records = [manager.lifecycle.get(h.request_id) for h in handles]
        return {
            "how": args.how,
            "model": args.model,
            "dtype": args.dtype,
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "finish_reasons": dict(collections.Counter(reason for reason, _, _ in results)),
            "errors": sorted({error for _, _, error in results if error}),
            "equal_to_reference": sum(tokens == reference for _, tokens, _ in results),
            "moves": sum(len(r.moves) for r in records),
            "tokens_sent_at_move": sorted(m.num_sent_tokens for r in records for m in r.moves),
            "longest_pause_s": round(max(max(g) for g in gaps), 3),
            "median_token_gap_s": round(statistics.median(x for g in gaps for x in g), 4),
            "seconds_after_the_event": round(elapsed, 2),
            "migrations": dict(manager.migrations),
        }
    finally:
        await manager.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--how", choices=("remove", "kill"), default="remove")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--after", type=int, default=8, help="tokens each stream has first")
    parser.add_argument("--timeout", type=float, default=0.0, help="the removal's drain (s)")
    parser.add_argument("--read-timeout", type=float, default=600.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    result = asyncio.run(main(parser.parse_args()))
    for key, value in result.items():
        print(f"{key:>26}: {value}")
    print(json.dumps(result))
