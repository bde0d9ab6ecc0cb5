"""yaied against llama.cpp on the same GGUF file, the same threads, the same machine (issue 31).

llama.cpp runs through llama-cpp-python, built from PyPI's source package into a throw-away
virtual environment (``--venv``, ``--build``; never a dependency of yaied): pip compiles
llama.cpp with ``--cmake-args`` (by default x86-64 up to AVX-512 BF16/VNNI without AMX, see
DEFAULT_CMAKE_ARGS). If it does not build, the script says so and reports yaied alone.

Figures, one JSON line each:

- ``batch1``: one request, a 512-token random prompt, 256 greedy tokens (W-single's shape):
  decode tok/s of each, yaied with ``--quantization gguf``; yaied's resident memory against
  the file's size plus its KV pool. Each side loads once in a process of its own and decodes
  ``--pairs`` times, the two alternated (this machine's speed drifts by more than the gap
  between them over a minute): each side's median, every pair's ratio and their median.
- ``c32``: each one's HTTP server (``yaied serve``, ``python -m llama_cpp.server``), 64
  distinct text prompts of about 100 tokens at concurrency 32, 64 tokens each (EOS banned by
  logit_bias on both), output tok/s over the wall time.

Models: ``--model default`` (the embedded SmolLM2-135M Q4_1 file), ``--model 1b-q4_0`` (a
synthetic file with Llama-3.2-1B's layer shapes and SmolLM2's tokenizer and 49152-token
vocabulary, random weights packed in Q4_0 by yaied, written once into the cache), ``--model
1b-q4_k_m`` (the same shapes in F16, quantized by llama.cpp's own Q4_K_M: Q4_K with Q6_K for
the tied head and some layers' V and down projections, as the files people download), ``--model
1b-q3_k_m`` (the same, llama.cpp's Q3_K_M: Q3_K with Q4_K/Q5_K for the attention output, V and
down projections and Q6_K for the head), ``--model 1b-iq4_xs`` (the same, llama.cpp's IQ4_XS,
without an importance matrix: IQ4_XS with Q5_K for V and two down projections and Q6_K for the
head), or a path.

    PYTHONPATH=. python scripts/bench_llamacpp.py --model default --threads 2
    chrt -f 10 python scripts/bench_llamacpp.py --model 1b-q4_0 --skip-serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_serving import free_port, stop_daemon, wait_healthy
from single_stream import OUTPUT_TOKENS, PROMPT_TOKENS, _engine_seconds

from yaied.kernels.cpu_isa import cpu_features

DEFAULT_VENV = Path(tempfile.gettempdir()) / "yaied-llamacpp-venv"
# Each of ggml's x86 extensions that this CPU lists in /proc/cpuinfo, AMX off: the GGML_NATIVE
# build (0.3.36) picked AMX on a Sapphire Rapids VM and crashed on its first eval, and a fixed
# list crashed on a Zen 4 (AVX-VNNI, which Zen 4 lacks, is not AVX512-VNNI). Override with
# --cmake-args.
GGML_FEATURES = [("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"),
                 ("AVX512", "avx512f"), ("AVX512_VBMI", "avx512vbmi"),
                 ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"),
                 ("AVX_VNNI", "avx_vnni")]  # fmt: skip
DEFAULT_CMAKE_ARGS = " ".join(
    ["-DGGML_NATIVE=OFF"]
    + [f"-DGGML_{name}={'ON' if flag in cpu_features() else 'OFF'}" for name, flag in GGML_FEATURES]
    + [f"-DGGML_{name}=OFF" for name in ("AMX_TILE", "AMX_INT8", "AMX_BF16")]
)
C32_PROMPTS, C32_CONCURRENCY, C32_OUTPUT = 64, 32, 64
# Between two batch-1 decodes: the other side's threads stop spinning and go to sleep.
SETTLE_SECONDS = 0.5

# Llama-3.2-1B's layers (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, MLP 8192), with
# SmolLM2's vocabulary so its tokenizer can ride along.
ONE_B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192)


def _log(message: str) -> None:
    print(f"[bench_llamacpp] {message}", file=sys.stderr, flush=True)


# -- llama-cpp-python in its own venv ---------------------------------------------------------


def llama_cpp_python(venv: Path, build: bool, timeout: float, cmake_args: str) -> Path | None:
    """The venv's python with llama_cpp importable, building it if asked; None if unavailable."""
    python = venv / "bin" / "python"
    if python.exists() and _imports(python):
        return python
    if not build:
        _log(f"no llama-cpp-python in {venv} (pass --build to compile it there)")
        return None
    _log(f"building llama-cpp-python from source into {venv} (a few minutes)")
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        # --no-cache-dir: pip's wheel cache is keyed by the source package, not by CMAKE_ARGS.
        pip = [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-cache-dir",
            "--no-binary",
            "llama-cpp-python",
        ]
        done = subprocess.run(
            [*pip, "llama-cpp-python[server]"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        _log(f"llama-cpp-python did not build: {exc}")
        return None
    if done.returncode != 0 or not _imports(python):
        _log(f"llama-cpp-python did not build (pip {done.returncode}): {done.stderr[-2000:]}")
        return None
    _log(f"built in {time.monotonic() - started:.0f} s")
    return python


def _imports(python: Path) -> bool:
    check = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True)
    return check.returncode == 0


# Each side is a process of its own that loads its model once, warms up, prints one JSON line
# (``ready``: what it measured once) and then answers each "run" line on its stdin with one
# decode's JSON line; ``paired_batch1`` alternates them.
_LLAMA_BATCH1 = r"""
import json, random, sys, time
from llama_cpp import Llama
path = sys.argv[1]
threads, prompt_len, out_len = (int(a) for a in sys.argv[2:5])
llm = Llama(model_path=path, n_ctx=prompt_len + out_len + 16, n_threads=threads,
            n_threads_batch=threads, n_batch=512, verbose=False, seed=0)
rng = random.Random(0)
vocab = llm.n_vocab()
def run(n_out):
    prompt = [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)]
    llm.reset()
    started = time.perf_counter(); first = None; count = 0
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == n_out:
            break
    return first - started, time.perf_counter() - started
run(8)  # warm-up
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    ttft, total = run(out_len)
    print(json.dumps({"ttft_ms": round(ttft * 1e3, 1),
                      "decode_tok_s": round((out_len - 1) / (total - ttft), 2)}), flush=True)
"""

# yaied's side, in a process of its own so that its resident memory is the engine's alone (not
# this script's, which may have just written a model file).
_YAIED_BATCH1 = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(int(sys.argv[3]))
from bench_llamacpp import yaied_batch1_loop
yaied_batch1_loop(__import__("pathlib").Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
"""


class _Side:
    """One side's process: ``ready`` is its first JSON line, ``run()`` one decode's."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (close() closes it)
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        self.ready = self._line()

    def _line(self) -> dict[str, Any]:
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._stderr.seek(0)
            raise RuntimeError(f"{self.name} batch 1 failed: {self._stderr.read()[-2000:]}")
        return json.loads(line)

    def run(self) -> dict[str, Any]:
        self._proc.stdin.write("run\n")
        self._proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def paired_batch1(
    python: Path | None, gguf: Path, threads: int, quantization: str, pairs: int
) -> dict[str, Any]:
    """Both sides loaded once, then ``pairs`` decodes each, alternated (yaied first in even
    pairs, llama.cpp first in odd ones) so that a drift of the machine's speed falls on both:
    each side's median and every pair's ratio. Without llama.cpp (python None), yaied alone."""
    here = str(Path(__file__).resolve().parent)
    sides = [_Side("yaied", [sys.executable, "-c", _YAIED_BATCH1, here, str(gguf), str(threads),
                             quantization])]  # fmt: skip
    try:
        if python is not None:
            sides.append(_Side("llama.cpp", [str(python), "-c", _LLAMA_BATCH1, str(gguf),
                                             str(threads), str(PROMPT_TOKENS),
                                             str(OUTPUT_TOKENS)]))  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {side.name: [] for side in sides}
        for pair in range(pairs):
            for side in sides if pair % 2 == 0 else sides[::-1]:
                time.sleep(SETTLE_SECONDS)
                runs[side.name].append(side.run())
    finally:
        for side in sides:
            side.close()
    ours = sides[0].ready | _medians(runs["yaied"])
    record: dict[str, Any] = {"yaied": ours, "pairs": pairs}
    if python is not None:
        record["llama_cpp"] = _medians(runs["llama.cpp"])
        ratios = [a["decode_tok_s"] / b["decode_tok_s"]
                  for a, b in zip(runs["yaied"], runs["llama.cpp"], strict=True)]  # fmt: skip
        record["pair_ratios"] = [round(r, 2) for r in ratios]
        record["ratio"] = round(statistics.median(ratios), 2)
    return record


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [run["decode_tok_s"] for run in runs]
    out = {"decode_tok_s": round(statistics.median(rates), 2), "decode_tok_s_runs": rates}
    if "ttft_ms" in runs[0]:
        out["ttft_ms"] = round(statistics.median(run["ttft_ms"] for run in runs), 1)
    return out


# -- yaied --------------------------------------------------------------------------------------


def _load_yaied(gguf: Path, threads: int, quantization: str) -> Any:
    from yaied import LLM

    max_len = 1024
    return LLM(
        str(gguf),
        quantization=quantization,
        threads=threads,
        max_model_len=max_len,
        kv_cache_gib=_kv_gib_for(gguf, max_len),
        show_progress=False,
    )


def yaied_batch1(gguf: Path, threads: int, quantization: str) -> dict[str, Any]:
    """One batch-1 measurement in this process: TTFT, decode tok/s and resident memory."""
    llm = _load_yaied(gguf, threads, quantization)
    try:
        fresh = _prompts(llm)
        _engine_seconds(llm, fresh(), 8)  # warm-up
        ttft = min(_engine_seconds(llm, fresh(), 1) for _ in range(2))
        total = _engine_seconds(llm, fresh(), OUTPUT_TOKENS)
        return _yaied_facts(llm, gguf, ttft) | {
            "decode_tok_s": round((OUTPUT_TOKENS - 1) / (total - ttft), 2)
        }
    finally:
        llm.close()


def yaied_batch1_loop(gguf: Path, threads: int, quantization: str) -> None:
    """paired_batch1's yaied side: loads, warms up, prints its facts, then a decode per "run"."""
    llm = _load_yaied(gguf, threads, quantization)
    try:
        fresh = _prompts(llm)
        _engine_seconds(llm, fresh(), 8)  # warm-up
        ttft = min(_engine_seconds(llm, fresh(), 1) for _ in range(2))
        print(json.dumps(_yaied_facts(llm, gguf, ttft)), flush=True)
        for _ in sys.stdin:
            total = _engine_seconds(llm, fresh(), OUTPUT_TOKENS)
            rate = round((OUTPUT_TOKENS - 1) / (total - ttft), 2)
            print(json.dumps({"decode_tok_s": rate}), flush=True)
    finally:
        llm.close()


def _prompts(llm: Any):
    rng = random.Random(0)
    vocab = llm.vocab_size

    def fresh() -> list[int]:
        return [rng.randrange(1000, vocab - 1000) for _ in range(PROMPT_TOKENS)]

    return fresh


def _yaied_facts(llm: Any, gguf: Path, ttft: float) -> dict[str, Any]:
    info = llm.engine.worker.info
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in llm.engine.worker.kv_caches)
    rss = _rss_bytes()
    file_bytes = gguf.stat().st_size
    return {
        "ttft_ms": round(ttft * 1e3, 1),
        "quantization": info.quantization or "none",
        "math_dtype": info.dtype,
        "cpu_isa": info.cpu_isa,
        "rss_bytes": rss,
        "file_bytes": file_bytes,
        "kv_pool_bytes": kv_bytes,
        "rss_over_file_plus_kv": round(rss / (file_bytes + kv_bytes), 3),
    }


def _kv_gib_for(gguf: Path, max_len: int) -> float:
    """A KV pool of about two full contexts (the memory target counts the KV pool)."""
    from yaied.worker.gguf_reader import open_gguf

    reader = open_gguf(gguf)
    arch = reader.get_field("general.architecture").contents()
    layers = int(reader.get_field(f"{arch}.block_count").contents())
    heads = int(reader.get_field(f"{arch}.attention.head_count").contents())
    kv_heads = int(reader.get_field(f"{arch}.attention.head_count_kv").contents())
    hidden = int(reader.get_field(f"{arch}.embedding_length").contents())
    per_token = 2 * layers * kv_heads * (hidden // heads) * 4  # fp32 at most
    return max(2 * max_len * per_token / 2**30, 0.01)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- HTTP at concurrency 32 ----------------------------------------------------------------------


def c32_prompts(seed: int = 0) -> list[str]:
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "winter", "orchard",
             "signal", "ladder", "quiet", "market", "thunder", "velvet", "compass", "garden",
             "saddle", "whistle", "marble", "candle", "forest"]  # fmt: skip
    rng = random.Random(seed)
    return [
        f"Note {i}: " + " ".join(rng.choice(words) for _ in range(90)) + ". Continue the note:"
        for i in range(C32_PROMPTS)
    ]


async def _drive(url: str, model: str, eos_ids: list[int]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=C32_CONCURRENCY + 4)
    bias = {str(i): -100 for i in eos_ids}
    semaphore = asyncio.Semaphore(C32_CONCURRENCY)

    async def one(client: httpx.AsyncClient, prompt: str) -> int:
        async with semaphore:
            body = {"model": model, "prompt": prompt, "max_tokens": C32_OUTPUT,
                    "temperature": 0.0, "logit_bias": bias}  # fmt: skip
            response = await client.post(url + "/v1/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=3600, limits=limits, trust_env=False) as client:
        await one(client, "Warm up:")
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p) for p in c32_prompts()))
        elapsed = time.perf_counter() - started
    return {
        "requests": len(counts),
        "output_tokens": sum(counts),
        "elapsed_s": round(elapsed, 2),
        "output_tok_s": round(sum(counts) / elapsed, 2),
    }


def serve_yaied(gguf: Path, threads: int, quantization: str) -> dict[str, Any]:
    port = free_port()
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(gguf),
            "--quantization", quantization, "--threads", str(threads), "--max-model-len", "1024",
            "--max-num-seqs", str(C32_CONCURRENCY)]  # fmt: skip
    code = f"from yaied.cli import main; raise SystemExit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 600)
        model = httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]
        return asyncio.run(_drive(url, model, _eos_ids(gguf)))
    finally:
        stop_daemon(proc)


def serve_llama(python: Path, gguf: Path, threads: int) -> dict[str, Any]:
    port = free_port()
    command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host",
               "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--n_ctx", "2048"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/v1/models", trust_env=False, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server did not start within 600 s")
            time.sleep(0.5)
        return asyncio.run(_drive(url, str(gguf), _eos_ids(gguf)))
    finally:
        stop_daemon(proc)


def _eos_ids(gguf: Path) -> list[int]:
    from yaied.worker.gguf_reader import open_gguf

    reader = open_gguf(gguf)
    ids = []
    for key in ("eos_token_id", "eot_token_id"):
        field = reader.get_field(f"tokenizer.ggml.{key}")
        if field is not None:
            ids.append(int(field.contents()))
    return sorted(set(ids))


# -- the models ---------------------------------------------------------------------------------


def model_file(name: str, llama_python: Path | None = None) -> Path:
    """The GGUF file of ``name``, written once into the cache for the 1B shapes (1b-q4_k_m is
    quantized by llama.cpp: ``llama_python``, the venv's python that imports llama_cpp)."""
    from yaied.worker.model_files import default_cache_dir, find_default_model_gguf

    if name == "default":
        return find_default_model_gguf()
    if name == "1b-q4_0":
        path = default_cache_dir() / "bench" / "llama-1b-shape-q4_0.gguf"
        if not path.exists():
            write_1b_q4_0(path, find_default_model_gguf())
        return path
    if name in LLAMA_CPP_MIXES:
        path = default_cache_dir() / "bench" / f"llama-1b-shape-{name[3:]}.gguf"
        if not path.exists():
            if llama_python is None:
                raise SystemExit(f"bench_llamacpp: --model {name} needs llama.cpp (--build)")
            write_1b_q4_k_m(path, find_default_model_gguf(), llama_python, LLAMA_CPP_MIXES[name])
        return path
    return Path(name)


# The 1B shapes quantized by llama.cpp: --model name -> llama_cpp's LLAMA_FTYPE_MOSTLY_<mix>
LLAMA_CPP_MIXES = {"1b-q4_k_m": "Q4_K_M", "1b-q3_k_m": "Q3_K_M", "1b-iq4_xs": "IQ4_XS"}


def write_1b_q4_k_m(path: Path, tokenizer_source: Path, python: Path, mix: str = "Q4_K_M") -> None:
    """write_1b_q4_0's model in F16, quantized to ``mix`` (Q4_K_M, Q3_K_M, IQ4_XS) by llama.cpp
    (``python``'s llama_cpp.llama_model_quantize); the 2 GB F16 file never stays behind."""
    f16, tmp = path.with_suffix(".f16.gguf"), path.with_suffix(".tmp")
    code = (
        "import ctypes, sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{mix}\n"
        "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), "
        "ctypes.byref(p)))"
    )
    try:
        write_1b_q4_0(f16, tokenizer_source, packed=False)
        _log(f"quantizing {f16} to {mix} with llama.cpp")
        subprocess.run([str(python), "-c", code, str(f16), str(tmp)], check=True)
        tmp.rename(path)
    finally:
        f16.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def write_1b_q4_0(path: Path, tokenizer_source: Path, packed: bool = True) -> None:
    """Random weights in Llama-3.2-1B's layer shapes, packed in Q4_0 (token embeddings too,
    tied to the head), with the tokenizer and its metadata copied from ``tokenizer_source``;
    in F16 where not ``packed``."""
    import gguf
    import numpy as np
    import torch

    from yaied.kernels.cpu_quant import Q4_0, quantize
    from yaied.worker.gguf_reader import open_gguf

    _log(f"writing {path} (once)")
    source = open_gguf(tokenizer_source)
    vocab = next(t for t in source.tensors if t.name == "token_embd.weight").shape[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    s = ONE_B
    writer.add_block_count(s["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(int(vocab))
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            _copy_field(writer, field)
    generator = torch.Generator().manual_seed(0)
    qtype = gguf.GGMLQuantizationType.Q4_0

    def add(name: str, rows: int, cols: int) -> None:
        weight = torch.randn(rows, cols, generator=generator) * 0.02
        if not packed:
            writer.add_tensor(name, weight.half().numpy())
            return
        writer.add_tensor(name, quantize(weight, Q4_0).numpy(), raw_dtype=qtype)

    add("token_embd.weight", int(vocab), s["hidden"])
    writer.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    head_dim = s["hidden"] // s["heads"]
    for i in range(s["layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(s["hidden"], dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(s["hidden"], dtype=np.float32))
        add(f"blk.{i}.attn_q.weight", s["hidden"], s["hidden"])
        add(f"blk.{i}.attn_k.weight", s["kv_heads"] * head_dim, s["hidden"])
        add(f"blk.{i}.attn_v.weight", s["kv_heads"] * head_dim, s["hidden"])
        add(f"blk.{i}.attn_output.weight", s["hidden"], s["hidden"])
        add(f"blk.{i}.ffn_gate.weight", s["ffn"], s["hidden"])
        add(f"blk.{i}.ffn_up.weight", s["ffn"], s["hidden"])
        add(f"blk.{i}.ffn_down.weight", s["hidden"], s["ffn"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


def _copy_field(writer: Any, field: Any) -> None:
    import gguf

    kind = field.types[0]
    value = field.contents()
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_array(field.name, value)
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(field.name, value)
    elif kind == gguf.GGUFValueType.BOOL:
        writer.add_bool(field.name, value)
    elif kind in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
        writer.add_float32(field.name, value)
    else:
        writer.add_uint32(field.name, int(value))


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="default",
        help="default | 1b-q4_0 | 1b-q4_k_m | 1b-q3_k_m | 1b-iq4_xs | a .gguf path",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quantization", default="gguf", help="yaied's model.quantization")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--build", action="store_true", help="build llama-cpp-python if absent")
    parser.add_argument("--build-timeout", type=float, default=1800.0)
    parser.add_argument("--cmake-args", default=DEFAULT_CMAKE_ARGS, help="CMAKE_ARGS for --build")
    parser.add_argument("--skip-serving", action="store_true", help="batch 1 only")
    parser.add_argument(
        "--pairs", type=int, default=3, help="batch-1 decodes of each side, alternated"
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")

    import torch

    torch.set_num_threads(args.threads)
    python = llama_cpp_python(args.venv, args.build, args.build_timeout, args.cmake_args)
    gguf = model_file(args.model, python)
    machine = {"cpu": _cpu_name(), "threads": args.threads, "model": args.model}
    machine["file"] = str(gguf)
    paired = paired_batch1(python, gguf, args.threads, args.quantization, args.pairs)
    print(json.dumps({"figure": "batch1", **machine, **paired}), flush=True)
    if args.skip_serving:
        return 0
    ours = serve_yaied(gguf, args.threads, args.quantization)
    record = {"figure": "c32", **machine, "yaied": ours}
    if python is not None:
        theirs = serve_llama(python, gguf, args.threads)
        record["llama_cpp"] = theirs
        record["ratio"] = round(ours["output_tok_s"] / theirs["output_tok_s"], 2)
    print(json.dumps(record), flush=True)
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
