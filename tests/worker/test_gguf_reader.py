"""The GGUF tensor table read from the header alone (worker/gguf_reader.py tensor_table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker import gguf_files
from tests.worker.gguf_files import T
from yaied.worker.gguf_reader import open_gguf, tensor_table


def _with_every_metadata_kind(writer) -> None:
    """Strings, a vocabulary-like string array, number arrays, bools: all skipped."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" * (i % 5) for i in range(300)])
    writer.add_token_scores([float(i) for i in range(300)])
    writer.add_token_types([1] * 300)
    writer.add_bool("yaied.test.flag", True)
    writer.add_float64("yaied.test.f64", 0.5)
    writer.add_uint64("yaied.test.u64", 7)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> Path:
    kinds = {"attn_q": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q8_0, "ffn_up": T.Q4_0}

    def type_of(name: str) -> T:
        return next((kind for part, kind in kinds.items() if part in name), T.F16)

    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    shape = gguf_files.Shape(hidden=256, ffn=256)
    return gguf_files.write_gguf(path, shape, type_of, edit=_with_every_metadata_kind)


def test_the_header_alone_gives_gguf_pys_tensor_table(mixed_file):
    """The start's memory estimate reads the table; gguf-py's reader parsed every field first
    (a 49k-token vocabulary: 1.7 s before the daemon listened)."""
    expected = [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.n_bytes))
        for t in open_gguf(mixed_file).tensors
    ]
    assert [tuple(t) for t in tensor_table(mixed_file)] == expected
    assert {t.ggml_type for t in tensor_table(mixed_file)} >= {T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0}


@pytest.mark.parametrize("keep", [3, 20, 200, -40])
def test_a_cut_header_is_a_value_error_naming_the_file(mixed_file, tmp_path, keep):
    data = mixed_file.read_bytes()
    header_end = open_gguf(mixed_file).tensors[-1].field.offset + 30  # inside the table
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if keep > 0 else header_end + keep])
    with pytest.raises(ValueError, match=r"cut\.gguf: unreadable GGUF header"):
        tensor_table(cut)
