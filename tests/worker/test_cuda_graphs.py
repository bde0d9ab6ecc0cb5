"""Decode CUDA graphs: the bucket arithmetic (any machine), and capture and replay on a tiny
random-weight model (CUDA): replayed decode steps give what the eager forward gives."""

from __future__ import annotations

import pytest
import torch

from yaied.worker.cuda_graphs import MAX_GRAPH_BATCH, graph_batch_sizes, padded_batch_size


def test_graph_sizes_are_1_2_4_then_multiples_of_8_up_to_max_batch():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graph_batch_sizes(10_000)[-1] == MAX_GRAPH_BATCH
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padding_picks_the_smallest_bucket_that_holds_the_batch():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(sizes, n) for n in (1, 3, 5, 8, 9, 63, 64)] == [
        1, 4, 8, 8, 16, 64, 64,
    ]  # fmt: skip
    assert padded_batch_size(sizes, 65) is None
    for n in range(1, 65):  # never more than 7 padding rows past 8
        assert padded_batch_size(sizes, n) - n <= (7 if n > 8 else 4)


def written(caches, where: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per layer, the K and V entries at the (page, offset) slots: [2, slots, kv_heads, dim]."""
    return [
        torch.stack([torch.stack([c[:, p, o] for p, o in where]) for c in (k, v)])
        for k, v in caches
    ]


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_replayed_decodes_match_eager_decodes(tiny_model_dirs):
    """Decode steps of 1 sequence, then twice of 3 (the size-1 graph, then 3 rows padded to the
    size-4 graph), each at new positions so every replay reads new inputs: the replayed hidden
    states are the graph's own output buffer, and they, their greedy tokens and the K/V the
    graph writes (into slots zeroed after the eager run) equal the eager forward's."""
    from yaied import LLM, SamplingParams
    from yaied.core.step import Batch, ScheduledSeq

    llm = LLM(
        str(tiny_model_dirs["qwen3"]),
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.3,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        show_progress=False,
    )
    with llm, torch.inference_mode():
        runner, pool = llm.engine.worker.runner, llm.engine.pool
        graphs, model, caches = runner.graphs, runner.model, runner.kv_caches
        assert graphs is not None and graphs.sizes == sorted(graphs.graphs) == [1, 2, 4]
        page_size = runner.page_size
        params = SamplingParams(max_tokens=8, temperature=0.0)
        prompts = [list(range(3, 40)), [7, 7, 7], [(i * 37) % 256 for i in range(20)]]
        pages = [pool.allocate(-(-(len(p) + 3) // page_size)) for p in prompts]
        try:
            prefills = [
                ScheduledSeq(f"s{i}", p, 0, pages[i], True, params) for i, p in enumerate(prompts)
            ]
            tokens = runner.execute(Batch(prefills, sum(map(len, prompts)))).sampled_token_ids
            positions = [len(p) for p in prompts]
            for count, size in ((1, 1), (3, 4), (3, 4)):
                assert graphs.padded_size(count, count) == size
                decodes = [
                    ScheduledSeq(f"s{i}", [tokens[i]], positions[i], pages[i], True, params)
                    for i in range(count)
                ]
                step = runner.triton.build(decodes, pad_decodes_to=size)
                slots = [
                    (pages[i][positions[i] // page_size], positions[i] % page_size)
                    for i in range(count)
                ]
                eager = model(step.input_ids, step.positions, caches, step.meta)[:count]
                eager_kv = written(caches, slots)
                for k, v in caches:
                    for page, offset in slots:
                        k[:, page, offset] = 0
                        v[:, page, offset] = 0
                replayed = graphs.run(step)
                assert replayed.data_ptr() == graphs.graphs[size].hidden.data_ptr()
                replayed = replayed[:count]
                torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
                for got, expected in zip(written(caches, slots), eager_kv, strict=True):
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
                greedy = model.compute_logits(replayed).argmax(-1).tolist()
                assert greedy == model.compute_logits(eager).argmax(-1).tolist()
                for i in range(count):  # the next step decodes what this one chose
                    tokens[i] = greedy[i]
                    positions[i] += 1
        finally:
            for p in pages:
                pool.free(p)
