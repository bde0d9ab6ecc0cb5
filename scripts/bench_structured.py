"""Structured outputs end to end, in-process through the engine (workloads W-json, W-tools).

    .venv/bin/python scripts/bench_structured.py [--model smollm2-135m-instruct]
        [--dtype float32] [--requests 20] [--max-tokens 256] [--runs 2] [--ttft-runs 30]
        [--workload json|tools]

- compile: building the model's compiler (xgrammar's vocabulary scan, once per process), then
  the cold compile of each schema of tests/structured/schemas.py, then a warm one (a cache hit
  through the same ``await grammars.compile`` the server runs), milliseconds;
- W-json: `--requests` chat requests at once, each with a different schema (the few-shot prompt
  of tests/structured/schemas.py, greedy), against the same prompts unconstrained for the same
  token counts (max_tokens = the constrained output's length, ignore_eos). A first constrained
  round fixes those lengths and fills the prefix cache, so every measured round finds the
  prompts cached; rounds alternate (unconstrained, constrained) `--runs` times and the best of
  each counts. ``ratio`` = constrained output tok/s / unconstrained;
- W-tools (``--workload tools``): the same, as tool calls: each request offers one tool whose
  parameters are its schema, with tool_choice required (one call), rendered the way the server
  renders tools for the default model's template and run under the same structural tag;
- TTFT at concurrency 1: one request alone, constrained with its grammar already compiled (a
  warm compile) against the same prompt unconstrained, `--ttft-runs` times alternating;
  ``warm_compile_ttft_ms`` is the difference of the medians (the cache lookup, the matcher and
  the first step's mask), and ``attributed_ms`` what those parts measure themselves (the
  await on the cache hit plus the first step's mask fill and apply), which a busy machine's
  step-time noise does not blur.

Prints one JSON object. Logs go to stderr.
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

from tests.structured.schemas import SCHEMA_CASES, example_messages  # noqa: E402
from yaied.core.config import load_config  # noqa: E402
from yaied.core.grammar_spec import GrammarSpec, make_spec  # noqa: E402
from yaied.core.request import SamplingParams  # noqa: E402
from yaied.engine.async_engine import AsyncEngine  # noqa: E402


async def run_one(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    first, tokens, reason = None, 0, None
    async for event in engine.generate(prompt, params):
        if event.token_ids and first is None:
            first = time.perf_counter() - start
        tokens += len(event.token_ids)
        reason = event.finish_reason
    return {"ttft": first, "tokens": tokens, "finish": str(reason)}


async def run_round(
    engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    results = await asyncio.gather(
        *(run_one(engine, p, sp) for p, sp in zip(prompts, params, strict=True))
    )
    return time.perf_counter() - start, list(results)


def compile_figures(engine: AsyncEngine, specs: list[GrammarSpec]) -> dict[str, Any]:
    grammars = engine.inputs.grammars
    start = time.perf_counter()
    grammars._built(specs[0])  # the compiler itself: xgrammar scans the vocabulary once
    build = time.perf_counter() - start
    cold = []
    for spec in specs:
        start = time.perf_counter()
        grammars.compile_sync(spec)
        cold.append((time.perf_counter() - start) * 1e3)

    async def warm() -> list[float]:
        out = []
        for _ in range(20):
            for spec in specs:
                start = time.perf_counter()
                await grammars.compile(spec)
                out.append((time.perf_counter() - start) * 1e3)
        return out

    warm_ms = asyncio.run(warm())
    return {
        "compiler_build_s": round(build, 3),
        "cold_compile_ms_median": round(statistics.median(cold), 2),
        "cold_compile_ms_max": round(max(cold), 2),
        "cold_compile_ms_total": round(sum(cold), 1),
        "warm_compile_ms_median": round(statistics.median(warm_ms), 4),
        "warm_compile_ms_max": round(max(warm_ms), 4),
    }


async def w_json(
    engine: AsyncEngine, prompts: list[list[int]], specs: list[GrammarSpec], args: Any
) -> dict[str, Any]:
    constrained = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=spec)
        for spec in specs
    ]
    _, first = await run_round(engine, prompts, constrained)  # lengths; fills the prefix cache
    lengths = [r["tokens"] for r in first]
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    mask_seconds = 0.0
    changed = 0  # constrained rounds whose greedy lengths differ from the first (bf16 batches)
    for _ in range(args.runs):
        seconds, results = await run_round(engine, prompts, free)
        assert [r["tokens"] for r in results] == lengths
        times["unconstrained"].append(seconds)
        rates["unconstrained"].append(sum(lengths) / seconds)
        before = engine.stats()["structured_output_mask_seconds"]
        seconds, results = await run_round(engine, prompts, constrained)
        mask_seconds = engine.stats()["structured_output_mask_seconds"] - before
        changed += [r["tokens"] for r in results] != lengths
        times["constrained"].append(seconds)
        rates["constrained"].append(sum(r["tokens"] for r in results) / seconds)
    total = sum(lengths)
    tok_s = {name: max(values) for name, values in rates.items()}
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": total,
        "finished_stop": sum(r["finish"] == "stop" for r in first),
        "constrained_tok_s": round(tok_s["constrained"], 1),
        "unconstrained_tok_s": round(tok_s["unconstrained"], 1),
        "ratio": round(tok_s["constrained"] / tok_s["unconstrained"], 3),
        "constrained_s": [round(t, 2) for t in times["constrained"]],
        "unconstrained_s": [round(t, 2) for t in times["unconstrained"]],
        "mask_s_last_constrained_round": round(mask_seconds, 3),
        "constrained_rounds_with_other_lengths": changed,
    }


async def ttft(
    engine: AsyncEngine, prompt: list[int], spec: GrammarSpec, runs: int
) -> dict[str, Any]:
    constrained = SamplingParams(max_tokens=1, temperature=0.0, structured=spec)
    free = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    await run_one(engine, prompt, constrained)  # compiled, and the prompt cached, before timing
    await run_one(engine, prompt, free)
    out: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    parts = []
    for _ in range(runs):
        out["unconstrained"].append((await run_one(engine, prompt, free))["ttft"] * 1e3)
        mask_before = engine.masks.seconds
        start = time.perf_counter()
        await engine.inputs.grammars.compile(spec)  # what generate() awaits: a cache hit
        lookup = time.perf_counter() - start
        out["constrained"].append((await run_one(engine, prompt, constrained))["ttft"] * 1e3)
        parts.append((lookup + engine.masks.seconds - mask_before) * 1e3)
    medians = {name: statistics.median(values) for name, values in out.items()}
    return {
        "runs": runs,
        "ttft_ms_unconstrained": round(medians["unconstrained"], 2),
        "ttft_ms_constrained_warm": round(medians["constrained"], 2),
        "warm_compile_ttft_ms": round(medians["constrained"] - medians["unconstrained"], 2),
        "attributed_ms_median": round(statistics.median(parts), 3),
        "attributed_ms_max": round(max(parts), 3),
    }


def tool_workload(engine: AsyncEngine, cases: list[Any]) -> tuple[list, list[list[int]]]:
    """W-tools: one tool per request, its parameters the case's schema, one forced call."""
    from yaied.tools.grammar import Tool, ToolChoice, output_structural_tag

    specs, prompts = [], []
    for k, case in enumerate(cases):
        tool = Tool(f"record_{k}", "Record the answer", case.schema)
        tag = output_structural_tag(
            tool_format="hermes", tools=[tool], choice=ToolChoice("required"), parallel=False
        )
        specs.append(make_spec("structural_tag", tag, "tools"))
        messages = example_messages(case)
        prompts.append(engine.inputs.chat_prompt(messages, tools=[tool.definition()])[0])
    return specs, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ttft-runs", type=int, default=30)
    parser.add_argument("--workload", choices=("json", "tools"), default="json")
    args = parser.parse_args()
    cases = SCHEMA_CASES[: args.requests]
    config = load_config(overrides={"model.model": args.model, "model.dtype": args.dtype})
    engine = AsyncEngine(config, show_progress=False)
    if args.workload == "tools":
        specs, prompts = tool_workload(engine, cases)
    else:
        specs = [make_spec("json_schema", case.schema, "guided_json") for case in cases]
        prompts = [engine.inputs.chat_prompt(example_messages(case))[0] for case in cases]
    out: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "workload": args.workload}
    out["compile"] = compile_figures(engine, specs)

    async def decode() -> None:
        out[f"w_{args.workload}"] = await w_json(engine, prompts, specs, args)
        out["ttft_concurrency_1"] = await ttft(engine, prompts[0], specs[0], args.ttft_runs)
        await engine.shutdown()

    asyncio.run(decode())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
