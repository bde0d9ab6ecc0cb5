"""The converted-model cache: each folder is complete or absent, across a crash or a power loss.

    <cache>/<name>/              a converted model, valid only with COMPLETE_MARKER inside
    <cache>/.<name>.tmp-XXXXXX/  a conversion in progress, or left by one that was killed
    <cache>/.<name>.lock         flock'ed by the process converting <name>

A conversion writes into its temporary folder, and ``seal`` fsyncs every file, then writes the
marker (fsynced) last, then fsyncs the folder. ``publish`` renames it into place and fsyncs the
cache folder. A rename is atomic but not durable on its own: without the fsyncs, a power loss can
leave the new name pointing at files whose data never reached the disk. A folder without the
marker (cut short under older code, or copied half-way) is rebuilt.

The lock serialises conversions of one name across processes (a router's engine processes all
resolve the same model at start-up), and tells a temporary folder of a live conversion from a
stale one: ``remove_stale_temporaries`` removes only those whose lock nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
COMPLETE_MARKER = ".yaied-complete"
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-[^/]+")


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def temporary_folder(folder: Path) -> Path:
    """A new, empty ``.<name>.tmp-XXXXXX`` beside ``folder``, readable by others (a cache may be
    shared with a service user)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    path.chmod(0o755)  # mkdtemp makes it private
    return path


def seal(folder: Path) -> None:
    """Every file in ``folder`` on disk, then the marker, then the folder's own entries."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            _fsync(path)
    marker = folder / COMPLETE_MARKER
    with marker.open("w") as out:
        out.write("written last: the files beside this one are complete\n")
        out.flush()
        os.fsync(out.fileno())
    for path in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        _fsync(path)
    _fsync(folder)


def publish(sealed: Path, folder: Path) -> None:
    """Rename a sealed temporary folder to ``folder``, durably. Raises OSError when ``folder``
    exists (another process published it first)."""
    sealed.rename(folder)
    _fsync(folder.parent)


def discard(folder: Path) -> None:
    """Remove an incomplete folder: renamed out of the way first (atomic), then deleted."""
    doomed = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    with contextlib.suppress(FileNotFoundError):  # already gone
        folder.rename(doomed / "old")
    shutil.rmtree(doomed, ignore_errors=True)


@contextlib.contextmanager
def conversion_lock(folder: Path) -> Iterator[None]:
    """Held while converting into ``folder``; a second process waits here for the first."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _lock_file(folder.parent, folder.name) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def remove_stale_temporaries(cache_dir: Path) -> list[Path]:
    """Remove the temporary folders of conversions that were killed (nobody holds their lock);
    returns what was removed. Run at start-up, before anything is resolved."""
    if not cache_dir.is_dir():
        return []
    removed = []
    for path in sorted(cache_dir.iterdir()):
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        with _lock_file(cache_dir, match["name"]) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live conversion's folder
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.warning("removed %d unfinished conversion folder(s) in %s", len(removed), cache_dir)
    return removed


@contextlib.contextmanager
def _lock_file(cache_dir: Path, name: str) -> Iterator[int]:
    """The open lock file of ``name``; closing it releases any lock taken on it (the kernel does
    the same when the process dies)."""
    fd = os.open(cache_dir / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield fd
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
