"""Greedy output of the native models equals transformers fp32, alone and in mixed batches."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import TINY_CONFIGS, assert_greedy_equal, hf_greedy
from yaied import LLM, SamplingParams

NEW_TOKENS = 24


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def pair(request, tiny_model_dirs):
    folder = tiny_model_dirs[request.param]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # A small step budget forces chunked prefill and mixes chunks with decodes.
    llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=48,
        max_num_seqs=16,
        kv_cache_gib=0.05,
        show_progress=False,
    )
    yield reference, llm
    llm.close()


def test_alone_and_in_a_batch_match_transformers(pair):
    reference, llm = pair
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(16, 3, 120, llm.vocab_size, seed=1)
    batched = llm.generate(prompts, params)
    for prompt, out in zip(prompts[:4], batched[:4], strict=True):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids  # batch composition never changes greedy output
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.finish_reason == "length"
        assert_greedy_equal(
            reference, prompt, out.token_ids, hf_greedy(reference, prompt, NEW_TOKENS)
        )
    stats = llm.stats()
    assert stats["num_free_pages"] == stats["num_pages"]


def test_logits_match_transformers(pair):
    """The last-position logits of a prefill agree with transformers to fp32 rounding."""
    reference, llm = pair
    runner = llm.engine.worker.runner
    prompt = random_prompts(1, 40, 40, llm.vocab_size, seed=7)[0]
    from yaied.core.step import ScheduledSeq

    pages = llm.engine.pool.allocate(llm.engine.pool.pages_for(len(prompt)))
    try:
        seq = ScheduledSeq("x", prompt, 0, pages, True, SamplingParams(temperature=0.0))
        prep = runner.packer.build([seq])
        with torch.inference_mode():
            hidden = runner.model(prep.input_ids, prep.positions, runner.kv_caches, prep.meta)
            ours = runner.model.compute_logits(hidden[prep.sample_rows])[0]
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    finally:
        llm.engine.pool.free(pages)


def test_torch_decode_path_gives_the_same_tokens(tiny_model_dirs, monkeypatch):
    """Where the CPU kernels cannot be built, the torch path serves the same tokens."""
    folder = str(tiny_model_dirs["qwen3"])
    prompts = random_prompts(12, 3, 80, 256, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for disabled in ("", "1"):
        monkeypatch.setenv("YAIED_DISABLE_CPU_KERNELS", disabled)
        with LLM(folder, dtype="float32", kv_cache_gib=0.01, show_progress=False) as llm:
            runner = llm.engine.worker.runner
            assert (runner.decode_kernel is None) == bool(disabled)
            assert (runner.prefill_kernel is None) == bool(disabled)
            assert (runner.model.fused_ops is None) == bool(disabled)
            outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_gpu_fused_kernels_give_the_same_tokens(kind, tiny_model_dirs, monkeypatch):
    """The GPU path's fused Triton kernels (run here in Triton's interpreter on the CPU model's
    tensors) in place of the torch elementwise ops: the same greedy tokens in fp32, batched with
    chunked prefill (qwen3: the rotary on q and k after their norms)."""
    from yaied.kernels.triton_common import interpreting
    from yaied.kernels.triton_fused import TritonFusedOps

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/worker/test_gpu_parity.py runs them on a GPU)")
    monkeypatch.setenv("YAIED_DISABLE_CPU_KERNELS", "1")  # the torch path, then the Triton ops
    prompts = random_prompts(6, 3, 40, 256, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    folder = str(tiny_model_dirs[kind])
    # no prefix cache: the second pass must prefill every prompt through the Triton ops too
    with LLM(folder, dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=32,
             enable_prefix_caching=False, show_progress=False) as llm:  # fmt: skip
        model = llm.engine.worker.runner.model
        assert model.fused_ops is None
        plain = [o.token_ids for o in llm.generate(prompts, params)]
        model.fused_ops = TritonFusedOps()  # use_fused_ops refuses CPU weights; tests may not
        fused = [o.token_ids for o in llm.generate(prompts, params)]
    assert fused == plain


def test_on_amx_tiles_the_decode_loop_takes_up_to_32_rows(tiny_model_dirs, caplog):
    """Where bf16 layers run on AMX tiles, a decode step of 9-32 streams runs in the decode loop
    (one C call) and gives the tokens the layer path gives (the same kernels, called from
    Python): every row's bits are its own."""
    from yaied.kernels.cpu_gemv import AMX_MAX_ROWS, CpuGemv

    gemv = CpuGemv.load()
    if gemv is None or not gemv.amx:
        pytest.skip("no AMX tiles on this CPU (or the kernel was built without them)")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(AMX_MAX_ROWS, 5, 40, 256, seed=8)
    folder = str(tiny_model_dirs["llama"])
    with LLM(folder, dtype="bfloat16", kv_cache_gib=0.02, show_progress=False) as llm:
        loop = llm.engine.worker.runner.model.decode_loop
        assert loop is not None and loop.max_rows() == AMX_MAX_ROWS
        kernel, rows = loop.loop, []
        loop.loop = _CountingLoop(kernel, rows)
        in_loop = [o.token_ids for o in llm.generate(prompts, params)]
        assert max(rows) > 8  # steps of more than 8 rows ran in the loop
        assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no step failed
        loop.loop, loop.max_rows = kernel, lambda: 8  # the layer path above 8 rows
        layer_path = [o.token_ids for o in llm.generate(prompts, params)]
    assert in_loop == layer_path


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_decode_kernels_change_no_token(kind, tiny_model_dirs, monkeypatch):
    """One stream in bf16 decodes through the CPU decode-step kernel and, where it builds, the
    few-row linear kernel (qwen2: with q/k/v bias); the same greedy tokens come out of the
    general path (rotary, K/V write and attention apart; oneDNN linears). Against transformers
    bf16 no such check holds: the two round at different places and part after a few tokens."""
    from yaied.worker import cpu_model
    from yaied.worker.models import llama

    folder = tiny_model_dirs[kind]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(4, 5, 60, 256, seed=3)

    def one_at_a_time() -> list[list[int]]:
        with LLM(str(folder), dtype="bfloat16", kv_cache_gib=0.02, show_progress=False) as llm:
            return [llm.generate([p], params)[0].token_ids for p in prompts]

    with_kernels = one_at_a_time()
    monkeypatch.setattr(cpu_model, "gemv_fits", lambda model: False)
    monkeypatch.setattr(llama, "decode_step_attention", lambda *args: None)
    assert one_at_a_time() == with_kernels


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decode_loop_gives_the_kernels_bits(kind, dtype, isa_level, tiny_model_dirs, monkeypatch):
    """A decode step of a few rows runs every layer in one C call (worker/models/decode_loop.py).
    The same layers run from Python over the same two kernels (the few-row linear, norm and SiLU
    included, and the decode step) give the same tokens and logprobs to the last bit, for one
    stream and for a batch of two; prompts (more rows) take the matmul path either way. At every
    ISA level, in bf16 and in dtype auto (fp32 math over bf16 weights below AVX512-BF16)."""
    from yaied.worker.attention import decode_step_attention
    from yaied.worker.models.llama import DecoderLayer

    def few_row_layer(self, x, delta, cos, sin, kv_cache, meta, ops):
        if x.shape[0] > 4:
            return layer_path(self, x, delta, cos, sin, kv_cache, meta, ops)
        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        qkv = attn.qkv_proj.few_rows.normed(delta, x, norm.weight, norm.eps)
        heads = decode_step_attention(qkv, attn.num_heads, cos, sin, kv_cache, meta, attn.scale)
        out = attn.o_proj.few_rows(heads)
        norm = self.post_attention_layernorm
        act = mlp.gate_up_proj.few_rows.normed(out, x, norm.weight, norm.eps, silu=True)
        return x, mlp.down_proj.few_rows(act)

    monkeypatch.setenv("YAIED_CPU_ISA", isa_level)
    layer_path = DecoderLayer.forward_fused
    folder = tiny_model_dirs[kind]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = random_prompts(3, 5, 60, 256, seed=11)
    runs = {}
    for name in ("loop", "python"):  # a fresh engine each: no prefix cache shared between them
        with LLM(str(folder), dtype=dtype, kv_cache_gib=0.02, show_progress=False) as llm:
            worker = llm.engine.worker
            assert worker.info.cpu_isa == isa_level
            model = worker.runner.model
            if model.decode_loop is None:
                pytest.skip("no C compiler for the CPU kernels")
            if name == "python":
                model.decode_loop = None
                monkeypatch.setattr(DecoderLayer, "forward_fused", few_row_layer)
            outs = [llm.generate(prompts[:1], params)[0]]
            outs += llm.generate(prompts[1:], params)
            runs[name] = [(o.token_ids, o.logprobs) for o in outs]
        monkeypatch.setattr(DecoderLayer, "forward_fused", layer_path)
    assert runs["loop"] == runs["python"]


def _sdpa_over_bf16_kv(module, query, key, value, *args, **kwargs):
    """transformers' SDPA over K and V rounded to bf16 and back: what bf16 pools hold."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = (t.to(torch.bfloat16).to(t.dtype) for t in (key, value))
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "auto"])
@pytest.mark.parametrize("kind", ["llama", "llama3-scaled", "qwen2"])
def test_fp32_math_over_bf16_weights_matches_transformers(
    kind, kv_cache_dtype, isa_level, tiny_model_dirs
):
    """dtype auto below AVX512-BF16 is fp32 math over bf16-stored linear weights and (under
    ``cache.kv_cache_dtype`` auto) bf16 KV pools: greedy output, alone and batched (the decode
    loop's few rows and the matmul path's many), equals transformers fp32 over the same weights
    rounded to bf16, and over K/V rounded to bf16 where the pools are, at every ISA level."""
    from transformers import AttentionInterface

    from yaied.kernels.cpu_isa import has_bf16_math

    if has_bf16_math(isa_level):
        pytest.skip("at this level dtype auto is bf16 math")
    folder = tiny_model_dirs[kind]
    bf16_pools = kv_cache_dtype == "auto"
    attention = "sdpa"
    if bf16_pools:
        attention = "yaied_test_sdpa_over_bf16_kv"
        AttentionInterface.register(attention, _sdpa_over_bf16_kv)
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attention
    ).eval()
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):  # a tied embedding is rounded with its head
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(6, 3, 80, 256, seed=5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("YAIED_CPU_ISA", isa_level)
        with LLM(
            str(folder),
            kv_cache_gib=0.02,
            max_num_batched_tokens=48,
            kv_cache_dtype=kv_cache_dtype,
            show_progress=False,
        ) as llm:
            info = llm.engine.worker.info
            assert (info.dtype, info.weight_dtype, info.kv_cache_dtype, info.cpu_isa) == (
                "float32",
                "bfloat16",
                "bfloat16" if bf16_pools else "float32",
                isa_level,
            )
            alone = [llm.generate([p], params)[0].token_ids for p in prompts[:2]]
            batched = [out.token_ids for out in llm.generate(prompts, params)]
    for prompt, ours in zip(prompts, batched, strict=True):
        assert_greedy_equal(reference, prompt, ours, hf_greedy(reference, prompt, NEW_TOKENS))
    for prompt, ours in zip(prompts[:2], alone, strict=True):
        assert_greedy_equal(reference, prompt, ours, hf_greedy(reference, prompt, NEW_TOKENS))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "auto"])
def test_under_fp32_math_the_decode_loop_takes_any_rows_on_the_panels(
    kv_cache_dtype, isa_level, tiny_model_dirs
):
    """fp32 math from avx2 up: every projection has the panel matmul's copy, so a decode step
    of more rows than the few-row kernel takes runs in the decode loop over the panels, and
    gives the tokens and logprobs the layer path gives over the same kernels, to the bit."""
    from yaied.kernels.cpu_gemv import MAX_ROWS
    from yaied.kernels.cpu_isa import has_bf16_math, level_rank

    if has_bf16_math(isa_level) or level_rank(isa_level) < level_rank("avx2"):
        pytest.skip("the panels serve fp32 math from avx2 up, below AVX512-BF16")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = random_prompts(20, 5, 40, 256, seed=9)
    runs, rows = {}, []
    for path in ("loop", "layers"):  # a fresh engine each: no prefix cache shared between them
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("YAIED_CPU_ISA", isa_level)
            folder = str(tiny_model_dirs["llama"])
            with LLM(
                folder, kv_cache_gib=0.02, kv_cache_dtype=kv_cache_dtype, show_progress=False
            ) as llm:
                loop = llm.engine.worker.runner.model.decode_loop
                assert loop is not None and loop.max_rows() > MAX_ROWS
                loop.loop = _CountingLoop(loop.loop, rows)
                if path == "layers":  # the layer path past the few-row kernel's rows
                    loop.max_rows = lambda: MAX_ROWS
                runs[path] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        if path == "loop":
            assert max(rows) > MAX_ROWS
            rows.clear()
    assert all(count <= MAX_ROWS for count in rows)
    assert runs["loop"] == runs["layers"]


class _CountingLoop:
    """A decode loop's C entry that notes the rows of each call."""

    def __init__(self, kernel, rows: list[int]) -> None:
        self.kernel, self.rows = kernel, rows

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, *args):
        self.rows.append(args[4].shape[0])  # x
        return self.kernel(*args)


def test_fp32_weights_decode_in_the_loop_on_the_panels(isa_level, tiny_model_dirs):
    """fp32 weights (a forced float32) from avx2 up live only as the panel matmul's copy, so
    every decode step, one stream or many, runs in the decode loop over the panels and gives
    the tokens and logprobs the layer path gives over the same kernels, to the bit. At the
    generic level the weights stay on F.linear and decodes take the layer path."""
    from yaied.kernels.cpu_gemv import MAX_ROWS
    from yaied.kernels.cpu_isa import level_rank

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = random_prompts(12, 5, 40, 256, seed=13)
    runs, rows = {}, []
    for path in ("loop", "layers"):  # a fresh engine each: no prefix cache shared between them
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("YAIED_CPU_ISA", isa_level)
            folder = str(tiny_model_dirs["llama"])
            with LLM(folder, dtype="float32", kv_cache_gib=0.02, show_progress=False) as llm:
                model = llm.engine.worker.runner.model
                if level_rank(isa_level) < level_rank("avx2"):
                    assert model.decode_loop is None
                    pytest.skip("fp32 weights take the panels from avx2 up")
                loop = model.decode_loop
                assert loop is not None and loop.max_rows() > MAX_ROWS
                loop.loop = _CountingLoop(loop.loop, rows)
                if path == "layers":
                    model.decode_loop = None
                outs = [llm.generate(prompts[:1], params)[0]]
                outs += llm.generate(prompts[1:], params)
                runs[path] = [(o.token_ids, o.logprobs) for o in outs]
        if path == "loop":
            assert min(rows) == 1 and max(rows) > MAX_ROWS
    assert runs["loop"] == runs["layers"]
