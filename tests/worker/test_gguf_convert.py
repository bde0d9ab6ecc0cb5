"""GGUF -> Hugging Face folder conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker import gguf_files
from yaied.worker import gguf_convert
from yaied.worker.gguf_convert import convert_gguf_to_hf_folder, hf_tensor_name
from yaied.worker.model_files import (
    find_default_model_gguf,
    iter_safetensors_weights,
    load_hf_config,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return find_default_model_gguf()


@pytest.fixture(scope="module")
def reference_tokenizer(default_gguf: Path):
    return AutoTokenizer.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, local_files_only=True
    )


def test_default_config(default_model_folder: Path) -> None:
    config = load_hf_config(default_model_folder)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    expected = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.rope_parameters["rope_theta"] == 1e5
    assert config.dtype == torch.float32
    generation = json.loads((default_model_folder / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == 2


@pytest.mark.slow  # transformers reads the default model's tokenizer from its GGUF file
def test_default_tokenizer_matches_gguf_tokenizer(
    default_model_folder: Path, reference_tokenizer
) -> None:
    tokenizer = load_tokenizer(default_model_folder)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Wie spät ist es? 東京 🙂"},
    ]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    texts = [
        "Hello, world!",
        "  leading spaces\tand\ttabs\n",
        "naïve café, 日本語, emoji 🤖🎉",
        chat,
    ]
    for text in texts:
        assert tokenizer.encode(text) == reference_tokenizer.encode(text), text
    # transformers' GGUF tokenizer takes its template from the `tokenizer.chat_template` metadata;
    # the folder must carry that one, not some default.
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.chat_template
    assert (default_model_folder / "chat_template.jinja").is_file() or "chat_template" in (
        default_model_folder / "tokenizer_config.json"
    ).read_text()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


# ---- tiny synthetic GGUF files: round trips through llama.cpp's layout -----------------------

_HIDDEN, _FFN, _LAYERS, _HEADS, _KV_HEADS, _VOCAB = 32, 48, 2, 4, 2, 64


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: interleave each head's two halves."""
    head_half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, 2, head_half, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def _random_hf_weights(arch: str, head_dim: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    q_rows, kv_rows = _HEADS * head_dim, _KV_HEADS * head_dim
    weights = {
        "model.embed_tokens.weight": rand(_VOCAB, _HIDDEN),
        "model.norm.weight": rand(_HIDDEN),
    }
    if not tied:
        weights["lm_head.weight"] = rand(_VOCAB, _HIDDEN)
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(_HIDDEN),
            p + "post_attention_layernorm.weight": rand(_HIDDEN),
            p + "self_attn.q_proj.weight": rand(q_rows, _HIDDEN),
            p + "self_attn.k_proj.weight": rand(kv_rows, _HIDDEN),
            p + "self_attn.v_proj.weight": rand(kv_rows, _HIDDEN),
            p + "self_attn.o_proj.weight": rand(_HIDDEN, q_rows),
            p + "mlp.gate_proj.weight": rand(_FFN, _HIDDEN),
            p + "mlp.up_proj.weight": rand(_FFN, _HIDDEN),
            p + "mlp.down_proj.weight": rand(_HIDDEN, _FFN),
        }
        if arch == "qwen2":
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                weights[p + f"self_attn.{proj}_proj.bias"] = rand(rows)
        if arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = rand(head_dim)
            weights[p + "self_attn.k_norm.weight"] = rand(head_dim)
    return weights


def _gguf_name(hf_name: str) -> str:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in names:
        return names[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    module, suffix = rest.rsplit(".", 1)
    kinds = {v: k for k, v in gguf_convert._LAYER_MODULES.items()}
    kinds |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    return f"blk.{layer}.{kinds[module]}.{suffix}"


def _write_tiny_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], head_dim: int) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(_VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, array in weights.items():
        if arch == "llama" and ".q_proj." in hf_name:
            array = _llama_cpp_permute(array, _HEADS)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = _llama_cpp_permute(array, _KV_HEADS)
        writer.add_tensor(_gguf_name(hf_name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "head_dim", "tied"),
    [("llama", 8, True), ("llama", 8, False), ("qwen2", 8, True), ("qwen3", 16, False)],
)
def test_synthetic_round_trip(tmp_path: Path, arch: str, head_dim: int, tied: bool) -> None:
    weights = _random_hf_weights(arch, head_dim, tied)
    _write_tiny_gguf(tmp_path / "tiny.gguf", arch, weights, head_dim)
    folder = convert_gguf_to_hf_folder(
        tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False
    )

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(weights)
        for name, expected in weights.items():
            assert torch.equal(handle.get_tensor(name), torch.from_numpy(expected)), name
    # The config must describe exactly these tensors to transformers' own model class.
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.head_dim == head_dim
    assert model.config.tie_word_embeddings == tied


def test_synthetic_llama_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    weights = _random_hf_weights("llama", 8, tied=False)
    _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", weights, 8)
    folder = convert_gguf_to_hf_folder(
        tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False
    )
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32, local_files_only=True
    ).state_dict()
    converted = dict(iter_safetensors_weights(folder, show_progress=False))
    assert set(converted) == set(reference)
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name


def test_unsupported_arch_names_supported_ones(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="falcon.*llama, qwen2, qwen3"):
        convert_gguf_to_hf_folder(tmp_path / "other.gguf", tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "other.gguf"]


def test_interrupted_conversion_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", _random_hf_weights("llama", 8, True), 8)

    def fail(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_save_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_hf_folder(tmp_path / "tiny.gguf", tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "tiny.gguf"]


def test_existing_output_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf_folder(tmp_path / "x.gguf", tmp_path / "out", show_progress=False)


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.3.attn_q.bias", "qwen2") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", "qwen3") == (
        "model.layers.0.self_attn.k_norm.weight"
    )
    with pytest.raises(ValueError, match="no Hugging Face counterpart"):
        hf_tensor_name("blk.0.attn_k_norm.weight", "llama")
    with pytest.raises(ValueError):
        hf_tensor_name("blk.0.ffn_gate_exps.weight", "llama")


@pytest.mark.parametrize("keep", [0, 10, 30, "tensor_info"])
def test_file_cut_before_the_data_is_one_clear_error(tmp_path: Path, keep: int | str) -> None:
    # Cut in the header, the metadata or the tensor list, gguf-py fails with numpy's or an
    # IndexError's message: the error names the file and says what is wrong with it.
    _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", _random_hf_weights("llama", 8, True), 8)
    data = (tmp_path / "tiny.gguf").read_bytes()
    if keep == "tensor_info":  # inside the last tensor's entry of the tensor list
        reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
        keep = reader.tensors[-1].field.offset + 12
        del reader
    (tmp_path / "cut.gguf").write_bytes(data[:keep])
    with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file \(truncated"):
        convert_gguf_to_hf_folder(tmp_path / "cut.gguf", tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory) -> Path:
    """A tiny llama, every projection in Q8_0 (written by gguf-py, as llama.cpp's quantize)."""
    path = tmp_path_factory.mktemp("q8") / "q8.gguf"
    return gguf_files.write_gguf(path, gguf_files.Shape(), gguf_files.every(gguf_files.T.Q8_0))


def _corrupted(q8_file: Path, tmp_path: Path, edit) -> Path:
    data = bytearray(q8_file.read_bytes())
    edit(data)
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    return tmp_path / "bad.gguf"


def test_a_table_longer_than_its_room_names_the_tensor(q8_file: Path, tmp_path: Path) -> None:
    """A tensor whose dims claim more rows than were written: its table runs over the next
    tensor's, inside the file. llama.cpp refuses it (each table ends where the next begins);
    here it loaded the next tensor's bytes as rows, and the error, if any, named another
    tensor (the config took ffn_up's rows for the FFN's size)."""
    bad = _corrupted(
        q8_file, tmp_path, lambda d: gguf_files.set_dims(d, "blk.0.ffn_up.weight", [64, 512])
    )
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ffn_up\.weight'.*overlaps") as exc:
        convert_gguf_to_hf_folder(bad, tmp_path / "out", show_progress=False)
    assert "\n" not in str(exc.value)


def test_a_table_at_another_tensors_offset_names_the_tensor(q8_file: Path, tmp_path: Path) -> None:
    """A tensor whose offset points into another's table loaded that tensor's weights in its
    place, silently."""

    def point_q_at_k(data: bytearray) -> None:
        q, k = (gguf_files.offset_field(data, f"blk.0.attn_{p}.weight") for p in "qk")
        data[q] = data[k]

    bad = _corrupted(q8_file, tmp_path, point_q_at_k)
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.attn_[qk]\.weight'.*overlaps"):
        convert_gguf_to_hf_folder(bad, tmp_path / "out", show_progress=False)


@pytest.mark.parametrize(
    ("tensor", "dims"),
    [("blk.0.ffn_up.weight", [64, 128]), ("blk.0.attn_v.weight", [64, 16])],
)
def test_a_table_shorter_than_its_room_names_the_tensor(
    q8_file: Path, tmp_path: Path, tensor: str, dims: list[int]
) -> None:
    """Dims that claim fewer rows than were written leave a gap before the next table (which
    llama.cpp refuses): the error named another weight (ffn_up's rows set the FFN's size, so
    down_proj was blamed) or was torch's bare 'The size of tensor a (32) must match the size of
    tensor b (16)'."""
    bad = _corrupted(q8_file, tmp_path, lambda d: gguf_files.set_dims(d, tensor, dims))
    with pytest.raises(ValueError, match=rf"GGUF tensor '{re.escape(tensor)}'.*before"):
        convert_gguf_to_hf_folder(bad, tmp_path / "out", show_progress=False)


def test_q4_k_rows_not_a_whole_number_of_super_blocks_name_the_tensor(tmp_path: Path) -> None:
    """GGUF stores whole blocks a row: a Q4_K tensor whose rows are 320 long (llama.cpp's
    quantize falls back to another type there) is corrupt, whatever its element count."""
    shape = gguf_files.Shape(hidden=256, ffn=512, head_dim=64)
    path = gguf_files.write_gguf(tmp_path / "k.gguf", shape, gguf_files.every(gguf_files.T.Q4_K))
    bad = _corrupted(
        path, tmp_path, lambda d: gguf_files.set_dims(d, "blk.1.ffn_down.weight", [320, 256])
    )
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight': rows of 320 .* Q4_K blocks"):
        convert_gguf_to_hf_folder(bad, tmp_path / "out", show_progress=False)


@pytest.mark.parametrize(
    ("tensor", "value", "kind"),
    [
        ("token_embd.weight", float("nan"), gguf_files.T.Q8_0),  # a row few prompts read
        ("blk.1.ffn_down.weight", float("inf"), gguf_files.T.Q8_0),
        ("blk.0.attn_v.weight", float("-inf"), gguf_files.T.F16),
    ],
    ids=["q8_0-nan-embeddings", "q8_0-inf", "f16-inf"],
)
def test_non_finite_weights_name_the_tensor(
    tmp_path: Path, tensor: str, value: float, kind
) -> None:
    """A NaN or infinite scale in one block (or value in a float table): the model loaded, and
    then every request that met the weight failed with 'non-finite values', or, for a row of
    the embeddings no prompt had read yet, nothing showed at all."""
    path = gguf_files.write_gguf(tmp_path / "m.gguf", gguf_files.Shape(), gguf_files.every(kind))
    start = gguf_files.table_start(path, tensor)
    bad = _corrupted(path, tmp_path, lambda d: struct.pack_into("<e", d, start, value))
    with pytest.raises(ValueError, match=rf"GGUF tensor '{re.escape(tensor)}'.*(NaN|infinite)"):
        convert_gguf_to_hf_folder(bad, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("lie", "named"),
    [
        ({"head_count": 8}, r"llama\.attention\.head_count = 8.*blk\.0\.attn_q\.weight"),
        ({"head_count": 0}, r"llama\.attention\.head_count = 0"),  # was a ZeroDivisionError
        ({"head_count": 3}, r"llama\.attention\.head_count = 3.*blk\.0\.attn_q\.weight"),
        ({"head_count_kv": 4}, r"head_count_kv = 4.*blk\.0\.attn_k\.weight"),
        ({"head_count_kv": 0}, r"llama\.attention\.head_count_kv = 0"),
        ({"key_length": 8}, r"key_length = 8.*blk\.0\.attn_q\.weight"),
        ({"block_count": 3}, r"llama\.block_count = 3.*no tensors of block 2"),
        ({"block_count": 1}, r"'blk\.1\.attn_norm\.weight' is beyond block_count 1"),
    ],
    ids=lambda v: None if isinstance(v, str) else "-".join(f"{k}{n}" for k, n in v.items()),
)
def test_metadata_that_disagrees_with_the_tensors_names_the_field(
    tmp_path: Path, lie: dict, named: str
) -> None:
    """Head counts, head size and block count that do not fit the tensors' shapes: one line
    naming the field (and the tensor it was checked against), before anything is written."""
    shape = gguf_files.Shape(lie=lie)
    path = gguf_files.write_gguf(tmp_path / "m.gguf", shape, gguf_files.every(gguf_files.T.Q8_0))
    with pytest.raises(ValueError, match=named) as exc:
        convert_gguf_to_hf_folder(path, tmp_path / "out", show_progress=False)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


Shape = gguf_files.Shape


@pytest.mark.parametrize(
    ("shape", "named"),
    [
        # the tensors agree with the counts, but 3 KV heads cannot serve 4 query heads in groups
        (Shape(heads=4, kv_heads=3),
         r"llama\.attention\.head_count_kv = 3 does not divide llama\.attention\.head_count = 4"),
        # no key_length: llama.cpp's head size is embedding_length / head_count (64 / 2 = 32),
        # which the q weight's 32 rows do not fit, though 2 heads of 16 would
        (Shape(heads=2, kv_heads=1),
         r"llama\.attention\.head_count = 2 .*llama\.embedding_length = 64.*blk\.0\.attn_q"),
        # counts and head size consistently wrong (8 x 8 = 4 x 16): the per-head norms tell
        (Shape(arch="qwen3", lie={"head_count": 8, "head_count_kv": 4, "key_length": 8}),
         r"qwen3\.attention\.key_length = 8.*blk\.0\.attn_q_norm\.weight has 16"),
        (Shape(lie={"embedding_length": 32}),
         r"llama\.embedding_length = 32.*token_embd\.weight has 64"),
        # an odd head size: RoPE turns pairs of dimensions
        (Shape(arch="qwen2", heads=4, kv_heads=2, head_dim=15, lie={"key_length": 15}),
         r"qwen2\.attention\.key_length = 15.*even"),
    ],
    ids=["kv-groups", "implied-head-size", "per-head-norms", "embedding-length", "odd-head"],
)  # fmt: skip
def test_head_counts_that_fit_the_tensors_but_not_the_model_name_the_field(
    tmp_path: Path, shape: gguf_files.Shape, named: str
) -> None:
    """Head counts that agree with the q and k weights were taken as they were, though no model
    has them: they converted (and were cached), then every call failed ("q and cache shapes
    disagree": KV heads in no whole groups), the load failed on a norm's shape, or the model
    ran on a head size its own metadata contradicts (which llama.cpp refuses)."""
    path = gguf_files.write_gguf(tmp_path / "m.gguf", shape, gguf_files.every(gguf_files.T.F32))
    with pytest.raises(ValueError, match=named) as exc:
        convert_gguf_to_hf_folder(path, tmp_path / "out", show_progress=False)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()
