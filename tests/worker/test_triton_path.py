"""The engine's Triton path (the GPU path) run on CPU in Triton's interpreter: greedy output
equals transformers with chunked prefill and prefix hits, and graph padding rows are inert."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import assert_greedy_equal, hf_greedy
from tests.kernels.triton_cases import interpreter_only
from yaied import LLM, SamplingParams
from yaied.core.step import Batch, ScheduledSeq

pytestmark = [interpreter_only, pytest.mark.timeout(120)]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def triton_llm(tiny_model_dirs):
    # llama3-scaled: one kv head for four query heads, tied embeddings, scaled rope.
    folder = tiny_model_dirs["llama3-scaled"]
    llm = LLM(
        str(folder),
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=24,  # prompts arrive in chunks, mixed with decodes
        max_num_seqs=4,
        kv_cache_gib=0.01,
        show_progress=False,
    )
    yield folder, llm
    llm.close()


def test_greedy_matches_transformers_with_chunks_and_prefix_hits(triton_llm):
    folder, llm = triton_llm
    base = [(i * 37) % 256 for i in range(40)]
    prompts = [base, base[:33] + [5, 6, 7], [9, 8, 7]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.stats()["prefix_cache_hits"] >= 16  # the second prompt reused a cached page
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf_greedy(reference, prompt, NEW_TOKENS)
        assert_greedy_equal(reference, prompt, out.token_ids, expected)


def test_overlapped_steps_take_their_inputs_from_the_step_in_flight(triton_llm):
    """engine.overlap_steps on the Triton path: the step ahead's input ids are written into the
    staged inputs on the device, from the sampled ids of the step before."""
    folder, llm = triton_llm
    overlapped = LLM(
        str(folder), dtype="float32", attention_backend="triton", overlap_steps="on",
        max_num_batched_tokens=24, max_num_seqs=4, kv_cache_gib=0.01, show_progress=False,
    )  # fmt: skip
    try:
        prompts = [[(i * 37) % 256 for i in range(12)], [9, 8, 7], [3, 1, 4, 1, 5]]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3, 5)]
        expected = [out.token_ids for out in llm.generate(prompts, params)]
        assert [out.token_ids for out in overlapped.generate(prompts, params)] == expected
        assert overlapped.stats()["num_steps_ahead"] > 0
    finally:
        overlapped.close()


def test_padding_rows_write_and_change_nothing(triton_llm):
    """A decode step padded to a graph bucket: the real rows' hidden states and K/V are those of
    the unpadded step (to matmul rounding: BLAS blocks 2 and 4 rows differently), and the pool
    changes only at the real rows' slots."""
    _, llm = triton_llm
    runner, pool = llm.engine.worker.runner, llm.engine.pool
    params = SamplingParams(max_tokens=1, temperature=0.0)
    pages = [pool.allocate(2), pool.allocate(1)]
    try:
        prompts = [list(range(3, 20)), [7, 7, 7]]
        prefills = [
            ScheduledSeq(f"p{i}", p, 0, pages[i], True, params) for i, p in enumerate(prompts)
        ]
        runner.execute(Batch(prefills, sum(len(p) for p in prompts)))
        decodes = [
            ScheduledSeq(f"p{i}", [11 + i], len(p), pages[i], True, params)
            for i, p in enumerate(prompts)
        ]
        page_size = runner.page_size
        written = [pages[i][len(p) // page_size] * page_size + len(p) % page_size
                   for i, p in enumerate(prompts)]  # fmt: skip
        results = []
        for pad in (0, 4):
            caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            with torch.inference_mode():  # as in the worker: the staging buffers are its tensors
                step = runner.triton.build(decodes, pad_decodes_to=pad)
                hidden = runner.model(step.input_ids, step.positions, caches, step.meta)
            assert step.meta.backend.num_decodes == max(pad, 2)
            for new, old in zip(caches, runner.kv_caches, strict=True):
                for tensor, before in zip(new, old, strict=True):  # K, then V
                    changed = (tensor != before).any(-1).flatten(1, 2).any(0).nonzero()
                    assert sorted(changed.flatten().tolist()) == sorted(written)
            results.append((hidden[:2], caches))
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
        for (k0, v0), (k1, v1) in zip(results[0][1], results[1][1], strict=True):
            torch.testing.assert_close(k0, k1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v0, v1, rtol=1e-5, atol=1e-5)
    finally:
        for p in pages:
            pool.free(p)


def test_host_staging_uploads_sections_in_one_buffer():
    from yaied.worker.gpu_packing import HostStaging

    staging = HostStaging(torch.device("cpu"))
    with torch.inference_mode():
        views = staging.upload([[1, 2, 3], [], [-1], list(range(5000))])
        assert [v.tolist() for v in views[:3]] == [[1, 2, 3], [], [-1]]
        assert views[3].tolist() == list(range(5000))  # grown past the first 4096 entries
        assert all(v.dtype == torch.int32 for v in views)
        # one buffer, every section 16-byte aligned (one Triton specialization per kernel)
        assert views[3].data_ptr() == views[0].data_ptr() + 8 * 4
        assert all(v.data_ptr() % 16 == 0 for v in views)
        again = staging.upload([[7]])
        assert again[0].tolist() == [7] and again[0].data_ptr() == views[0].data_ptr()


def test_host_staging_waits_for_the_last_copy_before_rewriting():
    """On a GPU the copy out of the pinned buffer is asynchronous and a step need not end with a
    sync (an empty tensor's copy back does not sync), so the next upload waits on its event."""
    from yaied.worker.gpu_packing import HostStaging

    seen = []

    class Event:
        def synchronize(self):
            seen.append(staging.host[:2].tolist())  # what the pending copy would still read

    staging = HostStaging(torch.device("cpu"))
    staging.asynchronous = True  # as on a GPU; the event is faked, the buffer is not pinned
    staging._record = Event
    with torch.inference_mode():
        staging.upload([[1, 2]])
        assert seen == []
        staging.upload([[3, 4]])
    assert seen == [[1, 2]]  # waited before the buffer was rewritten
    assert staging.host[:2].tolist() == [3, 4]
