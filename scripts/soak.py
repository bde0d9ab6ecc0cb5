"""A bounded soak test: thousands of mixed requests against a launched yaied daemon, then checks.

    .venv/bin/python scripts/soak.py            # 3000 requests, a few minutes on a small CPU
    .venv/bin/python scripts/soak.py --short    # 120 requests, about a minute (tests/test_soak.py)
    .venv/bin/python scripts/soak.py --hostile  # the load twice: alone, then among hostile clients

The daemon serves a tiny random-weight Llama that carries the default model's tokenizer and chat
template (so text prompts, chat and detokenization are real; the model is fast and its output is
random), or ``--model`` (the default model's name, a folder, a GGUF file). The load mixes chat and
completions, streaming and not, prompt lengths from a word to ~1k tokens, greedy and random
sampling with top-k/top-p/seeds/penalties/stops/logprobs, ``n`` of 1 or 2, a few invalid requests,
20% of streaming clients leaving mid-stream, some cancelling their stream through
``POST /v1/requests/{id}/cancel`` and reading it to its end, non-streaming clients giving up, and
bursts well above ``server.max_queue_len``.

Afterwards it checks that every request that was not abandoned got a complete answer or a clear
OpenAI error, none hung, the KV pages came back (``kv_cache_usage_perc`` 0, nothing in flight),
memory stayed bounded, and ``/health`` answers 200. One JSON summary goes to stdout; the exit code
is 0 when every check passed.

Memory: the daemon's RSS climbs over its first thousand or two requests (allocator arenas and
buffers for new batch shapes; 0.4-0.65 GiB on the tiny model) and then levels off. So the check is
on the second half of the run, where a leak keeps growing with every request served and warm-up
does not: at most ``--max-rss-growth-mib`` there, and at most ``--max-rss-mib`` in all.

``--hostile`` runs the same load a second time with ``--hostile-clients`` rule-breaking clients
beside it (scripts/soak_hostile.py: oversized, malformed, slow-uploading, slow-reading and
disconnecting) and adds checks: no hostile client got a 5xx or no answer, and the normal
clients' p99 latency stayed within ``--max-p99-ratio`` of the run without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import free_port, stop_daemon, wait_healthy  # noqa: E402
from soak_hostile import hostile_loop  # noqa: E402
from soak_load import MODEL_NAME, Outcome, RequestSpec, make_spec, run_request  # noqa: E402


def build_tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer, chat template and EOS ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from yaied.worker.model_files import DEFAULT_MODEL_NAME, resolve_model_folder

    source = resolve_model_folder(DEFAULT_MODEL_NAME, show_progress=False)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    generation = {"eos_token_id": json.loads((source / "config.json").read_text())["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def launch(args: argparse.Namespace, model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--model", model, "--served-model-name", MODEL_NAME]
    argv += ["--kv-cache-gib", str(args.kv_cache_gib), "--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--threads", str(args.threads)]
    env = dict(
        os.environ,
        YAIED_SERVER_MAX_QUEUE_LEN=str(args.queue_len),
        YAIED_SERVER_MAX_TOKENS_LIMIT="64",
        YAIED_SERVER_SSE_PING_SECONDS="2",
        YAIED_SERVER_BODY_TIMEOUT_SECONDS="2",  # the hostile mix's slow uploads
        YAIED_SERVER_SEND_TIMEOUT_SECONDS="2",  # and its slow readers
    )
    code = f"from yaied.cli import main; raise SystemExit(main({argv!r}))"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 300, log_hint=f"; see {log_path}")
    return proc, url


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^yaied:(\w+)\{[^}]*\} (\S+)$", text, re.MULTILINE)
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def run_load(
    args: argparse.Namespace, url: str, pid: int, hostile: list[str] | None = None
) -> tuple[list[Outcome], float, list[float]]:
    """Every request, with bursts mixed in; also the daemon's RSS sampled once a second. With
    ``hostile`` (a list to fill), hostile clients run beside the load until it is done."""
    done = asyncio.Event()
    rogues = None
    if hostile is not None:
        rogues = asyncio.create_task(hostile_loop(url, done, args.seed, args.hostile_clients))
    rng = random.Random(args.seed)
    specs = [make_spec(rng, i) for i in range(args.requests)]
    limit = asyncio.Semaphore(args.concurrency)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    # No keep-alive: a request sent on a connection the server is just closing as idle fails
    # with a transport error that says nothing about the daemon (clients retry those). With a
    # fresh connection each, any transport error is the daemon's.
    pool = httpx.Limits(
        max_connections=args.concurrency + args.burst_size + 8, max_keepalive_connections=0
    )
    rss: list[float] = []
    sampler = asyncio.create_task(_sample_rss(pid, rss))
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=pool) as client:

        async def limited(spec: RequestSpec) -> Outcome:
            async with limit:
                return await run_request(client, spec, args.request_timeout)

        tasks = []
        for i, spec in enumerate(specs):
            if args.burst_every and i and i % args.burst_every == 0:
                # A burst: many short requests at once, past the semaphore and the queue limit.
                burst = [make_spec(rng, -1, burst=True) for _ in range(args.burst_size)]
                tasks += [asyncio.create_task(run_request(client, s, 60)) for s in burst]
            tasks.append(asyncio.create_task(limited(spec)))
            await asyncio.sleep(0)  # let requests start as they are made, not all at the end
        outcomes = await asyncio.gather(*tasks)
    duration = time.monotonic() - start
    done.set()
    if rogues is not None:
        hostile.extend(await rogues)
    sampler.cancel()
    return outcomes, duration, rss


async def _sample_rss(pid: int, out: list[float]) -> None:
    while True:
        out.append(rss_mib(pid))
        await asyncio.sleep(1.0)


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing is in flight and no KV page is held (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = scrape(url)
        busy = stats["num_requests_running"] + stats["num_requests_waiting"]
        if (busy == 0 and stats["kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    kinds = Counter(o.kind for o in outcomes)
    errors = Counter(o.detail for o in outcomes if o.kind in ("client_error", "server_error"))
    return {
        "requests": len(outcomes),
        "outcomes": dict(sorted(kinds.items())),
        "errors_by_kind": dict(sorted(errors.items())),
        "stream_requests": sum(o.stream for o in outcomes),
        "output_tokens": sum(o.output_tokens for o in outcomes),
        "retried_429": sum(o.retries for o in outcomes),
        "broken_examples": [o.detail for o in outcomes if o.kind in ("broken", "hung")][:5],
        "p50_ok_latency_s": _percentile([o.latency for o in outcomes if o.kind == "ok"], 0.5),
        "p99_ok_latency_s": _percentile([o.latency for o in outcomes if o.kind == "ok"], 0.99),
    }


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else 0.0


def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = args.model or str(build_tiny_model(workdir / "tiny"))
    proc, url = launch(args, model, workdir / "daemon.log")
    try:
        asyncio.run(_warm_up(url))
        before = wait_idle(url, 30)
        rss_before = rss_mib(proc.pid)
        outcomes, duration, rss = asyncio.run(run_load(args, url, proc.pid))
        extra = {}
        if args.hostile:  # the same load again, now among hostile clients
            wait_idle(url, 60)
            hostile: list[str] = []
            again, duration_h, _ = asyncio.run(run_load(args, url, proc.pid, hostile))
            extra = _hostile_summary(summarize(outcomes), summarize(again), hostile, duration_h)
            outcomes += again
        after = wait_idle(url, 60)
        rss_after = rss_mib(proc.pid)
        health = httpx.get(url + "/health", timeout=10).status_code
        summary = {"mode": "short" if args.short else "full", "duration_s": round(duration, 1)}
        summary |= summarize(outcomes)
        summary |= {
            "requests_per_s": round(len(outcomes) / duration, 1),
            "preemptions": after.get("num_preemptions_total", 0.0),
            "kv_usage_before": before["kv_cache_usage_perc"],
            "kv_usage_after": after["kv_cache_usage_perc"],
            "in_flight_after": after["num_requests_running"] + after["num_requests_waiting"],
            "rss_mib_before": round(rss_before, 1),
            "rss_mib_after": round(rss_after, 1),
            "rss_growth_mib": round(rss_after - rss_before, 1),
            "rss_growth_last_half_mib": round(rss_after - rss[len(rss) // 2], 1),
            # Tenths of the run: growth that levels off is warm-up, a steady climb a leak.
            "rss_mib_by_tenth": [round(rss[len(rss) * i // 10], 1) for i in range(10)],
            "health_after": health,
        } | extra
    finally:
        stop_daemon(proc)
    summary["exit_code"] = proc.returncode
    summary["failures"] = failures(summary, args)
    summary["passed"] = not summary["failures"]
    return summary


async def _warm_up(url: str) -> None:
    """48 requests of the same mix first: the daemon's RSS climbs by 100-200 MiB over its first
    few hundred requests (allocator arenas, buffers for new shapes), then stays flat; the soak's
    growth should measure what comes after."""
    rng = random.Random(12345)
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> Outcome:
            async with limit:
                return await run_request(client, make_spec(rng, i), 120)

        await asyncio.gather(*(one(i) for i in range(48)))


def failures(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = []
    kinds = summary["outcomes"]
    for kind in ("hung", "broken", "server_error"):
        if kinds.get(kind):
            out.append(f"{kinds[kind]} {kind} request(s)")
    if summary["kv_usage_after"] != summary["kv_usage_before"] or summary["in_flight_after"]:
        out.append("KV pages or requests still held after the soak")
    if summary["rss_growth_last_half_mib"] > args.max_rss_growth_mib:
        out.append(f"RSS grew by {summary['rss_growth_last_half_mib']} MiB in the second half")
    if summary["rss_mib_after"] > args.max_rss_mib:
        out.append(f"RSS reached {summary['rss_mib_after']} MiB")
    if summary["health_after"] != 200:
        out.append(f"/health answered {summary['health_after']}")
    if summary["exit_code"] != 0:
        out.append(f"the daemon exited with {summary['exit_code']} on SIGTERM")
    if "hostile" in summary:
        bad = {k: n for k, n in summary["hostile"].items() if k.split()[1][0] in "5h"}
        if bad:
            out.append(f"hostile clients got 5xx or no answer: {bad}")
        if summary["p99_ratio"] > args.max_p99_ratio:
            out.append(f"normal p99 grew {summary['p99_ratio']}x among hostile clients")
    return out


def _hostile_summary(
    alone: dict[str, Any], among: dict[str, Any], hostile: list[str], duration: float
) -> dict[str, Any]:
    return {
        "p99_ok_latency_alone_s": alone["p99_ok_latency_s"],
        "p99_ok_latency_among_hostile_s": among["p99_ok_latency_s"],
        "p50_ok_latency_alone_s": alone["p50_ok_latency_s"],
        "p50_ok_latency_among_hostile_s": among["p50_ok_latency_s"],
        "p99_ratio": round(among["p99_ok_latency_s"] / max(alone["p99_ok_latency_s"], 1e-9), 2),
        "outcomes_among_hostile": among["outcomes"],
        "hostile_duration_s": round(duration, 1),
        "hostile_requests": len(hostile),
        "hostile": dict(sorted(Counter(hostile).items())),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="120 requests, about a minute")
    parser.add_argument("--model", default="", help="default: a tiny random model (see above)")
    parser.add_argument("--requests", type=int, default=None, help="default 3000 (short: 120)")
    parser.add_argument("--concurrency", type=int, default=None, help="default 40 (short: 16)")
    parser.add_argument("--burst-every", type=int, default=None, help="default 300 (short: 50)")
    parser.add_argument("--burst-size", type=int, default=64, help="requests fired at once")
    parser.add_argument("--queue-len", type=int, default=32, help="server.max_queue_len")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--request-timeout", type=float, default=180.0, help="a hang, past this")
    parser.add_argument("--max-rss-growth-mib", type=float, default=128.0, help="second half")
    parser.add_argument("--max-rss-mib", type=float, default=2048.0, help="the daemon's, at last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hostile", action="store_true", help="again among hostile clients")
    parser.add_argument("--hostile-clients", type=int, default=8, help="hostile at a time")
    parser.add_argument("--max-p99-ratio", type=float, default=1.5, help="among hostile / alone")
    args = parser.parse_args(argv)
    full = {"requests": 3000, "concurrency": 40, "burst_every": 300}
    short = {"requests": 120, "concurrency": 16, "burst_every": 40}
    for key, value in (short if args.short else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="yaied-soak-") as tmp:
        workdir = Path(tmp)
        try:
            summary = soak(args, workdir)
        except Exception:
            log = workdir / "daemon.log"
            if log.exists():
                sys.stderr.write(log.read_text(errors="replace")[-4000:])
            raise
        if not summary["passed"]:
            sys.stderr.write((workdir / "daemon.log").read_text(errors="replace")[-4000:])
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
