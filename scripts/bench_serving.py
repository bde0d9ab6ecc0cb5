"""Online serving benchmark against a yaied daemon, shaped like ``vllm bench serve``.

    .venv/bin/python scripts/bench_serving.py --launch --dataset random \
        --input-len 32 --output-len 8 --num-prompts 8 --max-concurrency 4
    .venv/bin/python scripts/bench_serving.py --workload W-mixed --request-rate 4

Every request is a streamed ``/v1/completions`` call with a token-id prompt (greedy, ignore_eos,
``max_tokens`` = the request's output length, usage included). Arrivals are Poisson at
``--request-rate`` (inf: all at once), optionally capped at ``--max-concurrency`` in flight.
One JSON line goes to stdout; logs go to stderr. Only loopback targets are allowed.

``--runs N`` repeats the load N times against the same daemon, run k with seed ``--seed + k``, so
every run sends fresh prompts the prefix cache cannot serve; one JSON line per run.
``--compare-hf`` times transformers' left-padded greedy ``generate`` on each run's prompts in this
process right after that run (the daemon idle, so nothing competes for the cores) and adds its
output tok/s and the ratio to that run's line (scripts/hf_baseline.py, as bench_offline.py does),
in its fastest dtype on this machine (``--hf-dtype fastest``: bf16 and fp32 each time a probe,
before the daemon starts). Each ratio pairs two neighbouring measurements: a shared machine's
speed drifts from minute to minute, and transformers timed once after all the runs compared each
run with another moment's machine.

Every line says what it ran on: the CPU's model name, the daemon's kernel ISA level and dtypes
(from its /health) and the copy bandwidth measured in this process before the daemon starts. A
``YAIED_CPU_ISA`` cap reaches the daemon, and holds torch's kernels to the level there and here.

Datasets: ``--workload W-mixed|W-decode|W-prefix`` reuses ``bench_offline.build_workload``
(the DESIGN.md prompts); ``--dataset random`` draws lengths (``--input-len`` or
``--input-len-min/max``), then token ids, from one ``random.Random(--seed)``. Token ids are drawn
from [0, vocab size): ``--vocab-size``, else the model's config.json.

Timings are taken at chunk arrival: TTFT at the first chunk, ITL between chunks, TPOT as
(end - first chunk) / (output tokens - 1), output tokens from the usage chunk. The server skips
chunks whose detokenized text is still held back, so a chunk can carry several tokens, and a
model without a tokenizer streams only its final chunk (no ITL).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson

SCRIPTS = Path(__file__).resolve().parent
WORKLOADS = ("W-mixed", "W-decode", "W-prefix")


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    end: float = 0.0
    output_tokens: int = 0  # from usage, else the chunk count
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


# -- the dataset ---------------------------------------------------------------------------------


def vocab_size_of(model: str) -> int:
    from yaied.worker.model_files import resolve_model_folder

    folder = resolve_model_folder(model, show_progress=False)
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def random_dataset(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    """All lengths first, then the ids, so lengths do not depend on the vocabulary."""
    rng = random.Random(args.seed)
    low = args.input_len_min if args.input_len_min is not None else args.input_len
    high = args.input_len_max if args.input_len_max is not None else args.input_len
    input_lens = [rng.randint(low, high) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in input_lens]
    return prompts, [args.output_len] * args.num_prompts


def build_requests(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[int]]:
    vocab = args.vocab_size or vocab_size_of(args.model)
    if args.workload is None:
        return random_dataset(argparse.Namespace(**{**vars(args), "seed": seed}), vocab)
    sys.path.insert(0, str(SCRIPTS))
    from bench_offline import build_workload  # the exact DESIGN.md prompts

    workload = build_workload(args.workload, vocab, seed=seed)
    return workload.prompts, workload.output_lens


Dataset = tuple[list[list[int]], list[int]]  # prompts, output lengths


def load_hf_reference(args: argparse.Namespace, probe: list[list[int]]) -> tuple[Any, dict]:
    """transformers in its fastest dtype here (probed on ``probe``), and the dtype record
    (scripts/hf_baseline.py)."""
    import torch

    sys.path.insert(0, str(SCRIPTS))
    from hf_baseline import fastest_hf_model

    return fastest_hf_model(args, None, probe, torch.device("cpu"), args.hf_dtype)


def hf_output_tok_s(model: Any, prompts: list[list[int]], output_lens: list[int]) -> float:
    """transformers' generate on one run's prompts: output tok/s."""
    import torch

    sys.path.insert(0, str(SCRIPTS))
    from hf_baseline import run_hf

    workload = argparse.Namespace(prompts=prompts, output_lens=output_lens)
    return sum(output_lens) / run_hf(model, workload, torch.device("cpu"))


def machine_record(base_url: str, bandwidth: float) -> dict[str, Any]:
    """The CPU, the daemon's kernel ISA level and dtypes (its /health), the copy bandwidth."""
    sys.path.insert(0, str(SCRIPTS))
    from machine import cpu_model_name

    health = httpx.get(base_url + "/health", timeout=10, trust_env=False).json()
    record = {"cpu": cpu_model_name(), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
    for field_name in ("cpu_isa", "dtype", "weight_dtype"):
        record[field_name] = health.get(field_name)
    return record


def measured_copy_bandwidth() -> float:
    sys.path.insert(0, str(SCRIPTS))
    from single_stream import copy_bandwidth

    return copy_bandwidth()


# -- one request ---------------------------------------------------------------------------------


async def send_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    result = RequestResult(len(prompt), max_tokens)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                await _read_sse(response, result)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    if result.error is None and not result.chunk_times:
        result.error = "no token chunk"
    return result


async def _read_sse(response: httpx.Response, result: RequestResult) -> None:
    usage_tokens = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        event = orjson.loads(data)
        if "error" in event:
            result.error = str(event["error"].get("message", event["error"]))
            break
        if event.get("choices"):  # the server skips empty chunks, so each one carries output
            result.chunk_times.append(now)
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
    result.output_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)


# -- the load ------------------------------------------------------------------------------------


async def run_load(args: argparse.Namespace, base_url: str, prompts, output_lens) -> tuple:
    """(results, wall seconds). Poisson gaps come from their own RNG, seeded by --seed."""
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    gaps = random.Random(args.seed + 1)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = await served_model(client, base_url)

        async def limited(prompt: list[int], max_tokens: int) -> RequestResult:
            if semaphore is None:
                return await send_one(client, url, model, prompt, max_tokens)
            async with semaphore:
                return await send_one(client, url, model, prompt, max_tokens)

        tasks = []
        started = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens, strict=True)):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(gaps.expovariate(args.request_rate))
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - started


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(base_url + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# -- the figures ---------------------------------------------------------------------------------


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in done]
    e2e = [(r.end - r.start) * 1e3 for r in done]
    # tpot: the mean gap per token after the first; itl: every gap between chunks, pooled.
    tpot = [
        (r.end - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1
    ]
    itl = [float(d) * 1e3 for r in done for d in np.diff(r.chunk_times)]
    record: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        arr = np.asarray(values, dtype=float)
        for stat, fn in (("mean", np.mean), ("median", np.median), ("p99", _p99)):
            record[f"{stat}_{name}"] = round(float(fn(arr)), 3) if arr.size else None
    errors = [r.error for r in results if r.error]
    if errors:
        record["first_error"] = errors[0]
    return record


def _p99(arr: np.ndarray) -> float:
    return float(np.percentile(arr, 99))


# -- the daemon ----------------------------------------------------------------------------------


def check_loopback(base_url: str) -> str | None:
    """None if `base_url` names a loopback host, else why not."""
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return f"refusing non-loopback target {host or base_url!r}: only 127.0.0.0/8, ::1, localhost"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_daemon(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model]
    argv += ["--dtype", args.dtype, "--load-format", args.load_format]
    argv += shlex.split(args.serve_args)
    code = f"from yaied.cli import main; raise SystemExit(main({argv!r}))"
    _log(f"launching yaied {' '.join(argv)}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, args.launch_timeout)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_hint: str = "") -> None:
    """Poll /health until it answers 200; stop the daemon and raise if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}{log_hint}")
        try:
            if httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_daemon(proc)
    raise RuntimeError(f"the daemon was not healthy within {timeout} s{log_hint}")


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true", help="start a daemon on a free port")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--serve-args", default="", help="more `yaied serve` flags, with --launch")
    parser.add_argument("--launch-timeout", type=float, default=300.0)
    parser.add_argument("--dataset", default="random", choices=("random",))
    parser.add_argument("--workload", choices=WORKLOADS, help="the DESIGN.md prompts instead")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--input-len-min", type=int)
    parser.add_argument("--input-len-max", type=int)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, help="default: the model's config.json")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = burst")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    parser.add_argument("--runs", type=int, default=1, help="run k uses seed --seed + k")
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers")
    parser.add_argument(
        "--hf-dtype",
        default="fastest",
        choices=("fastest", "bfloat16", "float32"),
        help="transformers' dtype; fastest: bf16 and fp32 each time a probe, the faster runs",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.request_rate <= 0:
        parser.error("--request-rate must be positive (inf for all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if min(args.input_len, args.output_len, args.num_prompts) < 1:
        parser.error("--input-len, --output-len and --num-prompts must be at least 1")
    return args


def _log(message: str) -> None:
    print(f"[bench_serving] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from yaied.kernels.cpu_isa import hold_torch_to_cap

    hold_torch_to_cap()  # transformers here, under a cap, keeps to it as the daemon does
    if not args.launch and (why := check_loopback(args.base_url)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost,::1")
    datasets = [build_requests(args, args.seed + k) for k in range(args.runs)]
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    records = []
    proc = None
    bandwidth = measured_copy_bandwidth()  # before the daemon competes for the memory
    hf_model, hf_record = None, {}
    if args.compare_hf:
        _log("loading the transformers model")
        hf_model, hf_record = load_hf_reference(args, datasets[0][0])
    try:
        base_url = args.base_url.rstrip("/")
        if args.launch:
            proc, base_url = launch_daemon(args)
        machine = machine_record(base_url, bandwidth)
        _log(f"on {machine}")
        for k, (prompts, output_lens) in enumerate(datasets):
            _log(f"run {k}: {len(prompts)} requests at rate {rate}, max concurrency "
                 f"{args.max_concurrency}")  # fmt: skip
            results, duration = asyncio.run(run_load(args, base_url, prompts, output_lens))
            record = {"dataset": args.workload or args.dataset, "model": args.model}
            record |= {"seed": args.seed + k, "request_rate": rate}
            record |= {"max_concurrency": args.max_concurrency}
            record |= summarize(results, duration) | machine
            if hf_model is not None:  # now, while the machine runs as it just did for yaied
                _log(f"run {k}: transformers generate on the same prompts")
                hf = hf_output_tok_s(hf_model, prompts, output_lens)
                record |= hf_record | {"hf_output_tok_s": round(hf, 2)}
                record["ratio"] = round(record["output_throughput"] / hf, 3)
            records.append(record)
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_daemon(proc)
    for record in records:
        sys.stdout.buffer.write(orjson.dumps(record) + b"\n")
    sys.stdout.flush()
    return 0 if all(record["failed"] == 0 for record in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
