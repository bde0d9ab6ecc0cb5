"""W-agent for bench_offline.py (``--workload W-agent``): prompts that carry a document and ask
for a copy or an edited copy, so most of the output repeats the prompt; for speculative decoding.

    .venv/bin/python scripts/bench_offline.py --workload W-agent --batch-size 1 --runs 3
    .venv/bin/python scripts/bench_offline.py --workload W-mixed --speculative-compare

Documents (one ``random.Random(seed)`` per prompt): a JSON list of 10-14 records (id, name, email,
city, score, tags) or a Python file of 4-6 small functions; the instruction asks for the
document back unchanged, with one field changed, or with one function renamed. Chat template of
the model, greedy, EOS ends the output (at most 384 tokens).

``--speculative-compare`` (any workload) runs the engine with speculation off and on
(``--num-speculative-tokens``, n-gram) interleaved (off, on, on, off, ...), one engine alive at a
time (built for its run, closed after: two engines in one process are two OpenMP teams, and once
a process holds more OpenMP threads than CPUs libgomp throttles every barrier's spin, so both ran
30-40% slower than alone), prints one JSON line per run and a summary with the ratio of their
decode tok/s and whether every output was identical. Decode tok/s: the output tokens after each
request's first, over the time from the last request's first token to the end (so prefill is
left out).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

NAMES = ("Ada", "Brook", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal")
CITIES = ("Lisbon", "Oslo", "Quito", "Accra", "Hanoi", "Perth", "Lyon", "Tartu", "Cusco")
TAGS = ("admin", "beta", "trial", "vip", "new", "legacy")
FUNCS = ("parse_line", "load_rows", "mean_of", "clamp", "merge_dicts", "slugify", "chunked")
AGENT_MAX_TOKENS = 384


def json_document(rng: random.Random) -> tuple[str, str]:
    records = [
        {
            "id": i + 1,
            "name": rng.choice(NAMES),
            "email": f"user{rng.randrange(1000)}@example.com",
            "city": rng.choice(CITIES),
            "score": round(rng.uniform(0, 100), 1),
            "tags": rng.sample(TAGS, 2),
        }
        for i in range(rng.randint(10, 14))
    ]
    text = json.dumps(records, indent=1)
    target = rng.randrange(len(records)) + 1
    edits = (
        "Repeat this JSON list exactly, with no other text.",
        f'Repeat this JSON list exactly, but set "city" of the record with id {target} to '
        '"Berlin". Output only the JSON.',
    )
    return f"```json\n{text}\n```", rng.choice(edits)


def code_document(rng: random.Random) -> tuple[str, str]:
    bodies = {
        "parse_line": "    parts = line.strip().split(',')\n    return [p.strip() for p in parts]",
        "load_rows": "    with open(path) as f:\n        return [parse_line(x) for x in f]",
        "mean_of": "    if not values:\n        return 0.0\n    return sum(values) / len(values)",
        "clamp": "    return max(low, min(high, value))",
        "merge_dicts": "    out = dict(a)\n    out.update(b)\n    return out",
        "slugify": "    return '-'.join(w.lower() for w in text.split() if w.isalnum())",
        "chunked": "    for i in range(0, len(items), size):\n        yield items[i : i + size]",
    }
    args = {
        "parse_line": "line",
        "load_rows": "path",
        "mean_of": "values",
        "clamp": "value, low, high",
        "merge_dicts": "a, b",
        "slugify": "text",
        "chunked": "items, size",
    }
    names = rng.sample(FUNCS, rng.randint(4, 6))
    text = "\n\n\n".join(f"def {n}({args[n]}):\n{bodies[n]}" for n in names)
    old = rng.choice(names)
    edits = (
        "Return this Python file exactly as it is, with no other text.",
        f"Return this whole Python file with the function `{old}` renamed to `{old}_v2`, and "
        "nothing else changed.",
    )
    return f"```python\n{text}\n```", rng.choice(edits)


def agent_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """``count`` chat prompts, alternating JSON and code documents."""
    prompts = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        document, ask = (json_document if i % 2 == 0 else code_document)(rng)
        messages = [{"role": "user", "content": f"{document}\n\n{ask}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def timed_generate(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """Every prompt at once through the engine's stream, with each request's first-token time."""

    async def one(prompt: list[int], p: Any, started: float) -> tuple[list[int], float, float]:
        tokens: list[int] = []
        first = None
        async for event in llm.engine.generate(prompt, p):
            if event.token_ids and first is None:
                first = time.perf_counter() - started
            tokens += event.token_ids
            if event.error:
                raise RuntimeError(event.error)
        return tokens, first or 0.0, time.perf_counter() - started

    async def all_of_them() -> list[tuple[list[int], float, float]]:
        started = time.perf_counter()
        pairs = zip(prompts, params, strict=True)
        return await asyncio.gather(*(one(pr, p, started) for pr, p in pairs))

    before = llm.stats()
    runs = llm._loop.run_until_complete(all_of_them())  # the LLM's own event loop
    after = llm.stats()
    outputs = [tokens for tokens, _, _ in runs]
    elapsed = max(end for _, _, end in runs)
    last_first = max(first for _, first, _ in runs)
    output_tokens = sum(len(t) for t in outputs)
    decode_tokens = output_tokens - len(outputs)
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens")
    keys += ("spec_decode_num_accepted_tokens", "num_steps")
    deltas = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    record = {
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "ttft_max_s": round(last_first, 3),
        "output_tok_s": round(output_tokens / elapsed, 2),
        "decode_tok_s": round(decode_tokens / max(elapsed - last_first, 1e-9), 2),
        **deltas,
    }
    if deltas["spec_decode_num_drafts"]:
        accepted = deltas["spec_decode_num_accepted_tokens"]
        record["acceptance_rate"] = round(accepted / deltas["spec_decode_num_draft_tokens"], 3)
        record["mean_acceptance_length"] = round(1 + accepted / deltas["spec_decode_num_drafts"], 3)
    return {"record": record, "outputs": outputs}


def workload_prompts(args: Any, llm: Any, run: int) -> tuple[list[list[int]], list[Any]]:
    """The run's prompts and params: W-agent here, the others from bench_offline."""
    from bench_offline import build_workload, trim_workload

    from yaied import SamplingParams

    if args.workload == "W-agent":
        prompts = agent_prompts(llm.tokenizer, args.batch_size, seed=run)
        params = SamplingParams(max_tokens=args.max_output_len or AGENT_MAX_TOKENS, temperature=0.0)
        return prompts, [params] * len(prompts)
    workload = build_workload(args.workload, llm.vocab_size, seed=run)
    workload = trim_workload(workload, args.num_prompts, args.max_output_len)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    return workload.prompts, params


def run_compare(args: Any, make_llm: Any) -> None:
    """Speculation off and on, interleaved; one JSON line per run, then the summary."""
    from yaied import SamplingParams

    totals = {False: [0, 0.0], True: [0, 0.0]}  # decode tokens, decode seconds
    identical = True
    for run in range(args.runs):
        outputs = {}
        order = (False, True) if run % 2 == 0 else (True, False)
        for on in order:
            llm = make_llm(speculative=on)  # the only engine alive (the docstring says why)
            try:
                llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))
                prompts, params = workload_prompts(args, llm, run)
                result = timed_generate(llm, prompts, params)
            finally:
                llm.close()
            record = {"workload": args.workload, "run": run, "speculative": on}
            record.update(result["record"], num_requests=len(prompts))
            print(json.dumps(record), flush=True)
            outputs[on] = result["outputs"]
            r = result["record"]
            totals[on][0] += r["output_tokens"] - len(prompts)
            totals[on][1] += r["elapsed_s"] - r["ttft_max_s"]
        identical &= outputs[False] == outputs[True]
    off, on = (totals[k][0] / totals[k][1] for k in (False, True))
    summary = {
        "workload": args.workload,
        "summary": True,
        "runs": args.runs,
        "decode_tok_s_off": round(off, 2),
        "decode_tok_s_on": round(on, 2),
        "speedup": round(on / off, 3),
        "outputs_identical": identical,
    }
    print(json.dumps(summary), flush=True)


def run_agent(args: Any, make_llm: Any) -> None:
    """bench_offline's entry: --speculative-compare, else one engine as configured."""
    if args.speculative_compare:
        run_compare(args, make_llm)
        return
    llm = make_llm(speculative=bool(args.speculative_method))
    try:
        for run in range(args.runs):
            prompts, params = workload_prompts(args, llm, run)
            result = timed_generate(llm, prompts, params)
            record = {"workload": args.workload, "run": run, "num_requests": len(prompts)}
            print(json.dumps({**record, **result["record"]}), flush=True)
    finally:
        llm.close()
