"""lm-evaluation-harness as a client of `yaied serve`: a small multiple-choice task
(lm_eval_task/) through `local-completions`, offline, and every per-choice log-likelihood it logs
checked against the same sum computed by yaied's offline API.

lm-eval scores a choice with one completion per (context, continuation): the prompt is the
context's token ids followed by the continuation's, with `echo: true, logprobs: 1, max_tokens: 1,
temperature: 0`, and the score is the sum of the echoed logprobs of the continuation's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.test_daemon import free_port, serve_command, wait_healthy  # noqa: E402
from yaied.worker.model_files import DEFAULT_MODEL_NAME  # noqa: E402

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "yaied_mc"
# The YAML names its data file relative to the repository root, where a person would run lm_eval;
# the test points a copy of it at the absolute path, so it works from any directory.
DATA_IN_YAML = "tests/clients/lm_eval_task/questions.jsonl"
NUM_QUESTIONS = 12  # of the task's 24: the limit keeps the suite's time in bounds
NUM_CHOICES = 4


def task_dir_copy(tmp_path: Path) -> Path:
    text = (TASK_DIR / f"{TASK}.yaml").read_text()
    assert DATA_IN_YAML in text
    folder = tmp_path / "tasks"
    folder.mkdir()
    data = (TASK_DIR / "questions.jsonl").resolve()
    (folder / f"{TASK}.yaml").write_text(text.replace(DATA_IN_YAML, str(data)))
    return folder


# lm-eval's Python API in a child process: lm_eval's CLI indexes every one of its built-in task
# files before it reads --include_path (8 s of the test's time here); a TaskManager without the
# defaults reads only this task. The model, its arguments and the scoring are the CLI's own.
RUN_LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

model_args, include_path, limit, out_path = sys.argv[1:]
out = simple_evaluate(
    model="local-completions",
    model_args=model_args,
    tasks=[{task!r}],
    task_manager=TaskManager(include_path=include_path, include_defaults=False),
    limit=int(limit),
    log_samples=True,
)
samples = [
    {{"doc_id": s["doc_id"], "arguments": [list(a) for a in s["arguments"]], "resps": s["resps"]}}
    for s in out["samples"][{task!r}]
]
with open(out_path, "w") as f:
    json.dump({{"results": out["results"], "samples": samples}}, f, default=str)
"""


def run_lm_eval(tmp_path: Path, port: int, tokenizer: Path) -> dict:
    """lm-eval's local-completions model against the daemon; returns its results and samples."""
    output = tmp_path / "lm-eval-out.json"
    model_args = ",".join(
        [
            f"model={DEFAULT_MODEL_NAME}",
            f"base_url=http://127.0.0.1:{port}/v1/completions",
            # The converted folder holds the model's tokenizer; lm-eval needs one to split each
            # request into context and continuation. Named explicitly: "auto" would probe the
            # server for /tokenizer_info first, which yaied does not serve.
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            # Send token ids (lm-eval's default). With tokenized_requests=False lm-eval decodes
            # its ids back to text and the server tokenizes that again: the scores then only line
            # up with lm-eval's context length when that round trip gives the same ids, which no
            # tokenizer promises across the context/continuation boundary.
            "tokenized_requests=True",
            "num_concurrent=4",  # several requests in flight, sharing their contexts' prefixes
        ]
    )
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"),
        TOKENIZERS_PARALLELISM="false",
        NO_PROXY="127.0.0.1,localhost",
    )
    argv = [sys.executable, "-c", RUN_LM_EVAL.format(task=TASK), model_args]
    argv += [str(task_dir_copy(tmp_path)), str(NUM_QUESTIONS), str(output)]
    log_path = tmp_path / "lm-eval.log"
    with open(log_path, "w") as log:
        code = subprocess.call(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    assert code == 0, log_path.read_text()[-6000:]
    return json.loads(output.read_text())


def logged_scores(output: dict) -> list[tuple[str, str, float, bool]]:
    """(context, continuation, log-likelihood, is_greedy) of every request lm-eval scored."""
    samples = output["samples"]
    assert sorted(s["doc_id"] for s in samples) == list(range(NUM_QUESTIONS))
    scores = []
    for sample in samples:
        assert len(sample["resps"]) == NUM_CHOICES
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            (logprob, is_greedy) = resp[0]
            scores.append((context, continuation, float(logprob), bool(is_greedy)))
    return scores


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_lm_eval_local_completions_matches_offline_logprobs(default_model_folder, tmp_path):
    port = free_port()
    # serve_command's KV pool is sized for tiny models: the default model's full context needs
    # about 0.37 GiB in fp32.
    code = serve_command(DEFAULT_MODEL_NAME, port, "--dtype", "float32", "--kv-cache-gib", "0.5")
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", log_path, timeout=120)
            output = run_lm_eval(tmp_path, port, default_model_folder)
            assert proc.poll() is None, log_path.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(timeout=30) == 0, log_path.read_text()
            finally:
                proc.kill()

    results = output["results"][TASK]
    assert 0.0 <= results["acc,none"] <= 1.0

    scores = logged_scores(output)
    assert len(scores) == NUM_QUESTIONS * NUM_CHOICES

    # Tokenized exactly as lm-eval did: its own model class splits each pair (a trailing space of
    # the context moves to the continuation; the whole string is encoded, then cut at the
    # context's length).
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from yaied import LLM, SamplingParams

    lm = LocalCompletionsAPI(
        model=DEFAULT_MODEL_NAME,
        base_url=f"http://127.0.0.1:{port}/v1/completions",
        tokenizer=str(default_model_folder),
        tokenizer_backend="huggingface",
    )
    pairs = [lm._encode_pair(context, continuation) for context, continuation, _, _ in scores]
    assert all(len(ctx) + len(cont) < lm.max_length for ctx, cont in pairs)  # no truncation

    llm = LLM(DEFAULT_MODEL_NAME, dtype="float32", show_progress=False, threads=1, kv_cache_gib=0.5)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
        outs = llm.generate([ctx + cont for ctx, cont in pairs], params)
    finally:
        llm.close()

    for (context, continuation, served, served_greedy), (ctx, cont), out in zip(
        scores, pairs, outs, strict=True
    ):
        scored = out.prompt_logprobs[len(ctx) :]
        assert [t.token_id for t in scored] == cont
        offline = sum(t.logprob for t in scored)
        where = f"{context!r} + {continuation!r}"
        assert served == pytest.approx(offline, abs=1e-4), where
        # lm-eval's is_greedy: every continuation token is its position's most likely one.
        # Compared unless some position is a near-tie (under 1e-4), which may flip between runs.
        greedy = all(t.token_id == t.top_ids[0] for t in scored)
        margins = [
            t.top_logprobs[0] - (t.top_logprobs[1] if t.token_id == t.top_ids[0] else t.logprob)
            for t in scored
        ]
        if min(margins) >= 1e-4:
            assert served_greedy == greedy, where
