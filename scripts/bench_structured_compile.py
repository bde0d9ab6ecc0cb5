"""Structured-output costs outside the engine: compile (cold and warm), matcher fill, mask apply.

    .venv/bin/python scripts/bench_structured_compile.py [--model smollm2-135m-instruct]
        [--rows 20] [--repeat 200] [--device cpu|cuda] [--json]

- cold compile: the first compile of each schema in tests/structured/schemas.py (and of a
  json_object, a regex, a choice and an EBNF spec) on a fresh compiler, milliseconds;
- warm compile: the same spec again, a cache hit through ``compile_async`` on an event loop;
- fill: `--rows` matchers in the middle of a JSON output each fill their bitmask row, one by one
  and through xgrammar's BatchGrammarMatcher;
- apply: `apply_bitmask` on `--rows` rows of float32 and bfloat16 logits of the model's
  vocabulary width (all rows, and the same rows spread over a batch twice as large).

Prints a table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.structured.schemas

import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402

from tests.structured.schemas import SCHEMA_CASES  # noqa: E402
from yaied.structured import (  # noqa: E402
    GrammarCompiler,
    SequenceMatcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
    make_spec,
)
from yaied.structured.tokenizer import build_tokenizer_info  # noqa: E402
from yaied.worker.model_files import resolve_model_folder  # noqa: E402

OTHER_SPECS = [
    ("json_object", "json_object", None),
    ("regex_phone", "regex", r"\(\d{3}\) \d{3}-\d{4}"),
    ("choice_3", "choice", ["positive", "negative", "neutral"]),
    ("ebnf_arith", "grammar", 'root ::= e\ne ::= t (("+" | "-") t)*\nt ::= [0-9]+ | "(" e ")"'),
]


def timed_us(fn: Any, repeat: int) -> float:
    """Median microseconds of `fn()` over `repeat` calls, after a few warm-up calls."""
    for _ in range(min(5, repeat)):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def bench_compile(tokenizer: Any, vocab_size: int, info: Any) -> dict[str, dict[str, float]]:
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer_info=info)
    specs = [(case.name, make_spec("json_schema", case.schema, "b")) for case in SCHEMA_CASES]
    specs += [(name, make_spec(kind, value, "b")) for name, kind, value in OTHER_SPECS]
    results: dict[str, dict[str, float]] = {}

    async def warm(spec: Any) -> float:
        start = time.perf_counter()
        await compiler.compile_async(spec)
        return time.perf_counter() - start

    for name, spec in specs:
        compiled = compiler.compile(spec)
        warm_s = min(asyncio.run(warm(spec)) for _ in range(3))
        results[name] = {
            "cold_ms": compiled.compile_seconds * 1e3,
            "warm_ms": warm_s * 1e3,
            "kib": compiled.memory_bytes / 1024,
        }
    compiler.close()
    return results


def bench_step(
    compiler: GrammarCompiler, tokenizer: Any, vocab_size: int, rows: int, repeat: int, device: str
) -> dict[str, float]:
    matchers = []
    for i in range(rows):
        case = SCHEMA_CASES[i % len(SCHEMA_CASES)]
        compiled = compiler.compile(make_spec("json_schema", case.schema, "b"))
        text = json.dumps(case.valid[0])
        matcher = SequenceMatcher.create(compiled)
        assert matcher.accept_tokens(tokenizer.encode(text, add_special_tokens=False)[:-2])
        matchers.append(matcher)
    compiled = matchers[0].compiled
    out = {"matcher_create_us": timed_us(lambda: SequenceMatcher.create(compiled), repeat)}
    bitmask = allocate_bitmask(2 * rows, vocab_size, device)
    row_ids = list(range(rows))
    out["fill_one_by_one_us"] = timed_us(lambda: fill_bitmasks(matchers, bitmask, row_ids), repeat)
    batch = xgr.BatchGrammarMatcher(max_threads="auto")
    out["fill_batch_us"] = timed_us(
        lambda: fill_bitmasks(matchers, bitmask, row_ids, batch=batch), repeat
    )
    spread = list(range(0, 2 * rows, 2))
    fill_bitmasks(matchers, bitmask, spread)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        dense = torch.randn(rows, vocab_size, device=device).to(dtype)
        sparse = torch.randn(2 * rows, vocab_size, device=device).to(dtype)

        def dense_apply(logits: torch.Tensor = dense) -> None:
            apply_bitmask(logits, bitmask, row_ids)
            sync()

        def sparse_apply(logits: torch.Tensor = sparse) -> None:
            apply_bitmask(logits, bitmask, spread)
            sync()

        out[f"apply_{name}_{rows}_of_{rows}_us"] = timed_us(dense_apply, repeat)
        out[f"apply_{name}_{rows}_of_{2 * rows}_us"] = timed_us(sparse_apply, repeat)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import transformers

    folder = resolve_model_folder(args.model, show_progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    start = time.perf_counter()
    info = build_tokenizer_info(tokenizer, vocab_size)
    info_s = time.perf_counter() - start
    compile_results = bench_compile(tokenizer, vocab_size, info)
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer_info=info)
    step = bench_step(compiler, tokenizer, vocab_size, args.rows, args.repeat, args.device)
    compiler.close()
    report = {
        "xgrammar": getattr(xgr, "__version__", None) or _version("xgrammar"),
        "torch": torch.__version__,
        "device": args.device,
        "vocab_size": vocab_size,
        "tokenizer_info_ms": info_s * 1e3,
        "compile": compile_results,
        "step": step,
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"xgrammar {report['xgrammar']}, torch {report['torch']}, device {args.device}")
    print(f"vocab {vocab_size}; tokenizer info {info_s * 1e3:.0f} ms")
    print(f"{'spec':36} {'cold ms':>9} {'warm ms':>9} {'KiB':>8}")
    for name, row in compile_results.items():
        print(f"{name:36} {row['cold_ms']:9.2f} {row['warm_ms']:9.3f} {row['kib']:8.0f}")
    cold = [row["cold_ms"] for row in compile_results.values()]
    print(f"{'median / max cold':36} {statistics.median(cold):9.2f} {max(cold):9.2f}")
    for name, value in step.items():
        print(f"{name:36} {value:12.1f}")


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
