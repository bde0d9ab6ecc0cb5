"""The vectorised sampler: each knob checked against a direct computation, rows independent."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from yaied.core.request import SamplingParams
from yaied.worker.sampler import SamplingTensors, process_logits, sample

VOCAB = 8


def draw(
    logits: torch.Tensor, params: list[SamplingParams], n: int = 4000, **rows: object
) -> torch.Tensor:
    """Sample n times per row; returns empirical frequencies [rows, vocab]. ``rows``: the
    per-row keyword lists of SamplingTensors.build."""
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), **rows)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(params), VOCAB)
    for _ in range(n):
        ids = sample(logits.clone(), tensors, generator)
        counts[torch.arange(len(params)), ids] += 1
    return counts / n


LOGITS = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])


def test_greedy_takes_argmax_and_mixes_with_random_rows():
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1, temperature=0.7),
    ]
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"))
    out = sample(logits, tensors, torch.Generator().manual_seed(1))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_temperature_matches_softmax():
    freq = draw(LOGITS, [SamplingParams(temperature=0.5)])[0]
    expected = torch.softmax(LOGITS[0] / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_keeps_only_k_tokens():
    freq = draw(LOGITS, [SamplingParams(temperature=1.0, top_k=3)])[0]
    assert freq[3:].sum() == 0
    expected = torch.softmax(LOGITS[0, :3], -1)
    assert torch.allclose(freq[:3], expected, atol=0.03)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.softmax(LOGITS[0], -1)  # 0.41, 0.25, 0.15, ...
    p = float(probs[0] + probs[1]) - 0.01  # needs the first two tokens
    freq = draw(LOGITS, [SamplingParams(temperature=1.0, top_p=p)])[0]
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], probs[:2] / probs[:2].sum(), atol=0.03)


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = torch.softmax(LOGITS[0], -1)
    min_p = 0.3  # keeps tokens with p >= 0.3 * p_max
    keep = probs >= min_p * probs.max()
    freq = draw(LOGITS, [SamplingParams(temperature=1.0, min_p=min_p)])[0]
    assert freq[~keep].sum() == 0
    assert torch.allclose(freq[keep], probs[keep] / probs[keep].sum(), atol=0.03)


def test_rows_use_their_own_settings():
    logits = LOGITS.repeat(2, 1)
    freq = draw(logits, [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)])
    assert freq[0, 2:].sum() == 0
    assert freq[1, 2:].sum() > 0


# --- logit_bias, penalties, min_tokens, seeds ---------------------------------------------------


def direct_processing(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], banned=()
) -> torch.Tensor:
    """The knobs written out token by token, as the OpenAI and transformers docs state them."""
    out = logits.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):  # repetition: prompt + output
        value = float(out[token])
        out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(output):  # frequency and presence: output only
        count = output.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    for token in banned:
        out[token] = float("-inf")
    return out


def test_bias_and_penalties_match_direct_formula():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    params = [
        SamplingParams(
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=-0.7,
            logit_bias={1: 2.5, 6: -1.0},
        ),
        SamplingParams(),  # untouched, between two processed rows
        SamplingParams(frequency_penalty=1.5, logit_bias={"4": 300}),  # clamped to 100
    ]
    prompts = [[0, 1, 1, 5], None, [2, 3]]
    outputs = [[1, 2, 2, 7, 2], None, [4, 4, 6]]
    tensors = SamplingTensors.build(
        params, VOCAB, torch.device("cpu"), prompt_ids=prompts, output_ids=outputs
    )
    ours = process_logits(logits, tensors)
    for row, p in enumerate(params):
        expected = direct_processing(logits[row], p, prompts[row] or [], outputs[row] or [])
        torch.testing.assert_close(ours[row], expected)
    assert ours[2, 4] > 90  # the bias was clamped, not dropped
    assert not torch.equal(ours[0], logits[0])


def test_greedy_with_penalties_is_argmax_of_processed_logits():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={(top[3] + 1) % VOCAB: 100}),
    ]
    outputs = [[top[0]] * 3, [top[1]], None, None]
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), output_ids=outputs)
    ids = sample(logits, tensors)
    for row, p in enumerate(params):
        expected = direct_processing(logits[row], p, [], outputs[row] or []).argmax()
        assert ids[row] == expected
    assert ids[0] != top[0] and ids[2] == top[2] and ids[3] == (top[3] + 1) % VOCAB


def test_min_tokens_bans_eos_and_stop_ids():
    logits = LOGITS.repeat(3, 1)  # token 0 is the most likely, then 1, 2...
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 2 + [SamplingParams()]
    banned = [(0, 2), (), ()]  # row 1 has reached min_tokens: nothing banned any more
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), banned_ids=banned)
    assert sample(LOGITS.repeat(3, 1), tensors)[:2].tolist() == [1, 0]
    freq = draw(logits, params, n=500, banned_ids=banned)
    assert freq[0, 0] == 0 and freq[0, 2] == 0 and freq[2, 0] > 0
    assert torch.equal(process_logits(logits, tensors)[1:], logits[1:])


def seeded_draws(rows: list[tuple[torch.Tensor, SamplingParams]], steps: int, seed: int):
    """Draw `steps` tokens for each row; row r at step i has produced i output tokens."""
    logits = torch.stack([row_logits for row_logits, _ in rows])
    params = [p for _, p in rows]
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for step in range(steps):
        tensors = SamplingTensors.build(
            params, VOCAB, torch.device("cpu"), num_output_tokens=[step] * len(rows)
        )
        draws.append(sample(logits, tensors, generator))
    return torch.stack(draws, dim=1)  # [rows, steps]


def test_seeded_rows_draw_the_same_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other_logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    alone = seeded_draws([(LOGITS[0], seeded)], 200, seed=0)[0]
    crowded = seeded_draws(
        [
            (other_logits[0], SamplingParams(temperature=0.8)),
            (other_logits[1], SamplingParams(temperature=0.0)),
            (LOGITS[0], seeded),
            (other_logits[2], SamplingParams(temperature=1.0, seed=99, top_k=3)),
        ],
        200,
        seed=1,  # the shared generator is in another state too
    )
    assert torch.equal(alone, crowded[2])
    assert len(set(alone.tolist())) > 3  # a fresh draw each step, not one repeated token
    other_seed = seeded_draws([(LOGITS[0], SamplingParams(temperature=1.0, seed=1235))], 200, 0)
    assert not torch.equal(alone, other_seed[0])


def test_seeded_draws_follow_the_distribution():
    seeded = SamplingParams(temperature=0.5, seed=7)
    ids = seeded_draws([(LOGITS[0], seeded)], 3000, seed=0)[0]
    freq = torch.bincount(ids, minlength=VOCAB) / len(ids)
    assert torch.allclose(freq, torch.softmax(LOGITS[0] / 0.5, -1), atol=0.03)


def test_unseeded_rows_stay_random_beside_seeded_ones():
    rows = [(LOGITS[0], SamplingParams(temperature=1.0, seed=3)), (LOGITS[0], SamplingParams())]
    first = seeded_draws(rows, 100, seed=0)
    second = seeded_draws(rows, 100, seed=1)
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[1], second[1])


def test_top_candidates_shortcut_equals_full_sort(monkeypatch):
    """top-k/top-p over the best candidates gives exactly what sorting the whole vocabulary
    gives, including rows whose top_p mass lies beyond the candidates (they fall back)."""
    from yaied.worker import sampler as sampler_module

    torch.manual_seed(0)
    vocab = 3000
    logits = torch.randn(6, vocab) * torch.tensor([[0.5], [3.0], [8.0], [1.0], [2.0], [0.2]])
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=40),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=1.0, top_p=0.99),  # needs far more than 64 candidates
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.3),
    ]
    tensors = SamplingTensors.build(params, vocab, torch.device("cpu"))

    def full(x):
        return sampler_module._filter_sorted(x, *x.sort(dim=-1, descending=True), tensors)

    expected = full(logits)
    for candidates in (64, 512):
        monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", candidates)
        got = sampler_module._apply_top_k_top_p(logits, tensors)
        assert torch.equal(got.isinf(), expected.isinf())
        torch.testing.assert_close(got[~got.isinf()], expected[~expected.isinf()])
    # and without the hard rows, the shortcut itself (no fallback) is taken and still exact
    easy = [1, 2, 4]
    tensors = SamplingTensors.build([params[i] for i in easy], vocab, torch.device("cpu"))
    monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", 512)
    sorts = []
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or 1 / 0)
    got = sampler_module._apply_top_k_top_p(logits[easy], tensors)
    assert not sorts  # the partial sort sufficed
    expected = sampler_module._filter_sorted(
        logits[easy], *torch.sort(logits[easy], dim=-1, descending=True), tensors
    )
    expected[2] = logits[4]  # the unfiltered row keeps every token
    torch.testing.assert_close(got, expected)


# --- the device path: no host reads, no generator per seeded row -------------------------------

# Ops that make the host wait for the device: their output's shape depends on the values, or
# they build a tensor from Python data mid-step (on a GPU: a pageable, synchronous upload).
SYNCING_OPS = {
    "nonzero", "argwhere", "masked_select", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "repeat_interleave", "bincount", "lift_fresh", "lift_fresh_copy",
}  # fmt: skip
INDEXING_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # nonzero on a bool mask
NUMBER_TYPES = {"number", "bool", "int", "float", "Scalar", "SymInt", "complex"}


class NoHostReads(TorchDispatchMode):
    """Fails any op that, run on a GPU, would make the host wait for the device: a value read
    back (item, bool, int, float and every other op that returns a number rather than a tensor),
    an output shaped by the values (nonzero, boolean-mask indexing, unique...), or a tensor made
    from Python data. CPU tensors stand in for device ones: the ops are the same."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        returns_number = any(str(r.type) in NUMBER_TYPES for r in func._schema.returns)
        mask_index = name in INDEXING_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in args[1]
            if i is not None
        )
        if name in SYNCING_OPS or returns_number or mask_index:
            raise AssertionError(f"{func} would wait for the device")
        return func(*args, **(kwargs or {}))


def no_tensor_to_python(*args, **kwargs):
    raise AssertionError("tolist/numpy would copy device values to the host")


KNOB_VOCAB = 3000


def knob_batch(spread: float) -> tuple[torch.Tensor, list[SamplingParams], dict]:
    """One row per knob; `spread` scales the logits (flat rows put their top_p mass beyond
    TOP_CANDIDATES candidates)."""
    generator = torch.Generator().manual_seed(11)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),  # no top-k cap
        SamplingParams(temperature=1.0, top_p=0.5, top_k=40),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0.9, logit_bias={7: 5.0, 2999: -3.0}),
        SamplingParams(temperature=1.0, min_tokens=3),
        SamplingParams(temperature=1.0, seed=42),
        SamplingParams(temperature=0.8, seed=43, top_k=3),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
    ]
    logits = torch.randn(len(params), KNOB_VOCAB, generator=generator) * spread
    outputs = [None] * len(params)
    outputs[6] = [1, 2, 2, 3]
    outputs[11] = [int(logits[11].argmax())] * 2
    banned = [()] * len(params)
    banned[8] = tuple(int(t) for t in logits[8].topk(5).indices)
    rows = dict(
        prompt_ids=[[4, 5, 6]] * len(params),
        output_ids=outputs,
        banned_ids=banned,
        num_output_tokens=list(range(len(params))),
    )
    return logits, params, rows


@pytest.mark.parametrize("spread", [0.2, 6.0])  # flat: top_p needs > 1024 tokens; peaked: not
def test_device_path_reads_nothing_back_and_samples_as_the_cpu_path(monkeypatch, spread):
    """The path a GPU runs, driven on CPU (told that reading values is not free there): every
    knob at once, and no op that would wait for the device. It samples what the CPU path (which
    may branch on values: they are in host memory) samples."""
    from yaied.worker import sampler as sampler_module

    logits, params, rows = knob_batch(spread)
    tensors = SamplingTensors.build(params, KNOB_VOCAB, torch.device("cpu"), **rows)
    on_cpu = sample(logits, tensors, torch.Generator().manual_seed(5))
    with monkeypatch.context() as patch:
        patch.setattr(sampler_module, "_reads_are_free", lambda device: False)
        patch.setattr(torch.Tensor, "tolist", no_tensor_to_python)
        patch.setattr(torch.Tensor, "numpy", no_tensor_to_python)
        generator = torch.Generator().manual_seed(5)
        with NoHostReads():
            on_device = sample(logits, tensors, generator)
    assert torch.equal(on_device, on_cpu)
    assert on_cpu[0] == logits[0].argmax() and on_cpu[8] not in rows["banned_ids"][8]


def test_the_host_read_guard_sees_a_value_read():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), NoHostReads():
        bool(torch.ones(2).sum() > 1)
    with pytest.raises(AssertionError, match="index"), NoHostReads():
        torch.arange(4)[torch.arange(4) > 1]


def test_step_settings_travel_in_one_copy_per_dtype(monkeypatch):
    """Moving a step's settings off the host packs every tensor of one dtype into one buffer
    and copies it once, without blocking; each setting comes back whole, in its place."""
    from yaied.worker import sampler as sampler_module

    _, params, rows = knob_batch(1.0)
    host = SamplingTensors.build(params, KNOB_VOCAB, torch.device("cpu"), **rows)
    copies = []

    def fake_copy(self, device, non_blocking=False):  # a clone stands in for the device copy
        copies.append((self.dtype, non_blocking))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "to", fake_copy)
    moved = sampler_module._to_device(host, torch.device("meta"))
    before = list(sampler_module._tensor_leaves(host))
    after = list(sampler_module._tensor_leaves(moved))
    assert len(before) == len(after) > 12  # penalties, bias, bans and seeds included
    for old, new in zip(before, after, strict=True):
        assert new.dtype == old.dtype and torch.equal(new, old)
    assert sorted(copies, key=str) == sorted({(t.dtype, True) for t in before}, key=str)
    assert (moved.max_top_k, moved.top_p_reach, moved.all_seeded) == (50, KNOB_VOCAB, False)


@pytest.mark.cuda
def test_cuda_sampling_never_waits_for_the_device(monkeypatch):
    """With CUDA's sync debug mode raising on any synchronising call, a step's tensors are built
    and sampled with every knob at once, and every upload comes from pinned memory without
    blocking. The tokens are the CPU path's wherever float rounding cannot decide them: greedy
    rows, and seeded rows (their noise is the same integer hash on both devices)."""
    device = torch.device("cuda")
    logits, params, rows = knob_batch(0.2)
    on_device = logits.to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    real_to = torch.Tensor.to
    uploads = []

    def recording_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "cuda":
            uploads.append((self, kwargs.get("non_blocking", False)))
        return out

    torch.cuda.synchronize()
    steps = []
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "to", recording_to)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):  # later steps run on the allocators' cached blocks
                tensors = SamplingTensors.build(params, KNOB_VOCAB, device, **rows)
                steps.append(sample(on_device, tensors, generator))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert uploads and all(host.is_pinned() and non_blocking for host, non_blocking in uploads)
    ids = torch.stack(steps).cpu()  # [steps, rows]
    cpu_tensors = SamplingTensors.build(params, KNOB_VOCAB, torch.device("cpu"), **rows)
    on_cpu = sample(logits, cpu_tensors, torch.Generator().manual_seed(0))
    for row in (0, 9, 10, 11):  # greedy, seeded, seeded with top-k, greedy with a penalty
        assert ids[:, row].tolist() == [int(on_cpu[row])] * len(steps)
    assert not set(ids[:, 8].tolist()) & set(rows["banned_ids"][8])
    assert set(ids[:, 10].tolist()) <= set(logits[10].topk(3).indices.tolist())


def test_seeded_rows_need_no_generator_of_their_own(monkeypatch):
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)] + [SamplingParams()]
    tensors = SamplingTensors.build(params, VOCAB, torch.device("cpu"), num_output_tokens=[3] * 3)
    generator = torch.Generator().manual_seed(0)

    def no_generator(*args, **kwargs):
        raise AssertionError("a torch.Generator built for a seeded row")

    monkeypatch.setattr(torch, "Generator", no_generator)
    ids = sample(LOGITS.repeat(3, 1), tensors, generator)
    assert ids.shape == (3,)


def reference_uniform(key: tuple[int, int], token: int) -> float:
    """The seeded noise's uniform draw for one token, on Python ints: murmur3's 32-bit finaliser
    over the Weyl sequence key_lo + token * golden ratio, the key's high word mixed in after the
    first multiply; the top 23 bits, centred, give a uniform in (0, 1)."""
    mask = 0xFFFFFFFF
    lo, hi = (k & mask for k in key)
    x = (lo + token * 0x9E3779B9) & mask
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & mask
    x ^= hi
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & mask
    x ^= x >> 16
    return ((x >> 9) + 0.5) / 2**23


def test_seeded_noise_is_a_hash_of_the_key_and_token():
    """Each row's Exp(1) noise is -log(u) of a counter-based hash of (row key, token id): exact
    integer arithmetic, so the same on every device and for any batch or vocabulary size."""
    from yaied.worker.sampler import _hashed_exp1, _seed_key

    keys = [(0, 0), (-1, -1), (2**31 - 1, -(2**31)), _seed_key(1234, 0), _seed_key(1234, 1)]
    assert all(-(2**31) <= k < 2**31 for key in keys for k in key)
    assert _seed_key(1234, 1) != _seed_key(1235, 0)  # mixed, not added
    noise = _hashed_exp1(torch.tensor(keys, dtype=torch.int32), 5000)
    tokens = [0, 1, 2, 4095, 4999]
    expected = torch.tensor([[reference_uniform(k, t) for t in tokens] for k in keys])
    torch.testing.assert_close(noise[:, tokens], -expected.log(), rtol=1e-6, atol=0)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert torch.equal(
        _hashed_exp1(torch.tensor(keys[::-1], dtype=torch.int32), 10), noise.flip(0)[:, :10]
    )
    uniform = (-noise).exp()
    assert abs(float(uniform.mean()) - 0.5) < 0.01 and abs(float(uniform.var()) - 1 / 12) < 0.005
