"""The converted-model cache survives a crash at any point: a folder is used only with its
completion marker, written after every file is on disk; a folder without it is rebuilt; the
temporary folder of a killed conversion is removed at the next start, a live one's is not."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.worker.test_model_files import _write_tiny_gguf, converted_folders
from yaied.worker import model_cache
from yaied.worker.model_cache import COMPLETE_MARKER
from yaied.worker.model_files import resolve_model_folder


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    return path


def resolve(gguf: Path, cache: Path) -> Path:
    return resolve_model_folder(str(gguf), cache_dir=cache, show_progress=False)


def test_a_conversion_is_sealed_file_by_file_before_it_is_renamed(tiny_gguf, tmp_path, monkeypatch):
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    cache = tmp_path / "cache"
    folder = resolve(tiny_gguf, cache)
    assert (folder / COMPLETE_MARKER).is_file()
    names = [Path(p).name for p in synced]
    temporary = Path(synced[0]).parent.name
    assert temporary.startswith(f".{folder.name}.tmp-")
    # Every file, then the marker, then the temporary folder; after the rename, the cache folder.
    marker = names.index(COMPLETE_MARKER)
    assert {"model.safetensors", "config.json"} <= set(names[:marker])
    assert names[marker + 1 :] == [temporary, cache.name]
    assert resolve(tiny_gguf, cache) == folder  # reused as is


def test_a_folder_without_the_marker_is_rebuilt(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    folder = resolve(tiny_gguf, cache)
    size = (folder / "model.safetensors").stat().st_size
    # What a power loss after an unsynced rename leaves: the names, not the data.
    (folder / COMPLETE_MARKER).unlink()
    (folder / "model.safetensors").write_bytes(b"")
    assert resolve(tiny_gguf, cache) == folder
    assert (folder / COMPLETE_MARKER).is_file()
    assert (folder / "model.safetensors").stat().st_size == size
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    assert "model.embed_tokens.weight" in names
    assert converted_folders(cache) == [folder.name]


def test_stale_temporary_folders_go_at_start_and_live_ones_stay(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    stale = cache / ".tiny-0123456789ab.tmp-x1y2z3"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"half")
    live = cache / ".other-0123456789ab.tmp-a1b2c3"
    live.mkdir()
    # A conversion of "other-..." is running in another process: it holds the name's lock.
    holder = os.open(cache / ".other-0123456789ab.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        resolve(tiny_gguf, cache)
        assert not stale.exists() and live.exists()
    finally:
        os.close(holder)
    assert model_cache.remove_stale_temporaries(cache) == [live]  # its converter died


def test_a_conversion_waits_for_one_of_the_same_name(tiny_gguf, tmp_path):
    """Two processes resolving one model (a router's engine processes at start-up): the second
    waits for the first's lock and finds its folder complete, converting nothing."""
    import threading

    cache = tmp_path / "cache"
    first = resolve(tiny_gguf, cache)
    (first / COMPLETE_MARKER).unlink()  # so that the waiter must look again after the lock
    results: list[Path] = []
    with model_cache.conversion_lock(first):
        waiter = threading.Thread(target=lambda: results.append(resolve(tiny_gguf, cache)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # blocked on the lock
        model_cache.seal(first)  # the "other process" finishes
    waiter.join(10)
    assert results == [first]
    assert converted_folders(cache) == [first.name]
