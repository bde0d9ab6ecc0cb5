"""Opening a GGUF file: gguf-py's reader, with what it leaves unchecked checked before anything
is read, so that a truncated or corrupt file stops the load with one line naming the tensor or
the field, never a numpy message, an IndexError or weights read from the wrong bytes."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf


class _BlockTableError(ValueError):
    """A tensor's block table found truncated or corrupt (the message names the tensor)."""


class _CheckedReader(gguf.GGUFReader):
    """gguf-py's reader, with each tensor's block table checked against the file before it is
    mapped: a truncated or corrupt table stops the load with a message naming the tensor
    (gguf-py's own error is a bare numpy reshape message)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        tables = []  # (start, end, name) of every table
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
            name = str(bytes(name_data), encoding="utf-8", errors="replace")
            try:
                kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise _BlockTableError(
                    f"GGUF tensor {name!r} has type {int(raw_dtype[0])}, which gguf-py does not "
                    "know: corrupt file, or a type newer than this yaied"
                ) from None
            block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
            dims = [int(dim) for dim in dims]
            elements = math.prod(dims)  # Python ints: a garbled dim does not wrap around
            row = dims[0] if dims else 1
            if row % block_size:  # GGUF stores whole blocks a row
                raise _BlockTableError(
                    f"GGUF tensor {name!r}: rows of {row} are not a whole number of "
                    f"{kind.name} blocks of {block_size} (dims {dims}): corrupt block table"
                )
            start = start_offs + int(offset[0])
            end = start + elements // block_size * type_size
            if end > size:
                raise _BlockTableError(
                    f"GGUF tensor {name!r}: its {kind.name} block table ends at byte {end}, past "
                    f"the end of the file ({size} bytes): truncated or corrupt"
                )
            tables.append((start, end, name))
        # Each table ends where the next begins, but for the padding to the file's alignment
        # (as llama.cpp demands): one that runs into another's, or stops short of the next,
        # has dims or an offset that are not its own.
        tables.sort()
        pairs = list(zip(tables, tables[1:], strict=False))
        for (_, end, name), (start, _, other) in pairs:  # overlaps first: a moved offset
            if end > start:  # leaves a gap too, before a tensor that is not to blame
                raise _BlockTableError(
                    f"GGUF tensor {name!r}: its block table (to byte {end}) overlaps "
                    f"{other!r}'s (from byte {start}): wrong dims or offset, corrupt"
                )
        alignment = int(self.alignment)
        for (_, end, name), (start, _, other) in pairs:
            if start - end >= alignment:
                raise _BlockTableError(
                    f"GGUF tensor {name!r}: its block table ends at byte {end}, {start - end} "
                    f"bytes before {other!r}'s begins: wrong dims or offset, corrupt"
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A reader over ``path`` whose tensors' tables lie inside the file (_CheckedReader). A
    header, metadata or tensor list cut short or garbled is a ValueError naming the file (gguf-py
    fails there with numpy's or an IndexError's message)."""
    try:
        return _CheckedReader(path)
    except _BlockTableError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt): {exc}"
        ) from None


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def required_metadata(reader: gguf.GGUFReader, key: str) -> Any:
    value = metadata(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}, which the config needs")
    return value


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF's order: the row length first
    ggml_type: int
    nbytes: int


# Bytes of each fixed-size GGUF metadata value type (gguf.GGUFValueType): 8 is a string, 9 an
# array, whose elements are one type given before them.
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def tensor_table(path: Path) -> list[TensorInfo]:
    """The tensors ``path`` lists (names, shapes, types, bytes), from its header alone: the
    metadata is skipped, not parsed. gguf-py's reader parses every field (a vocabulary of 49k
    to 150k strings: 1-3 s), which a caller that only counts the tensors (the start's memory
    estimate) need not pay. A ValueError where the header is not one this reads (a file
    check_model_reference or open_gguf then names)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _tensor_table(data)
        except (struct.error, KeyError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path}: unreadable GGUF header ({exc})") from None


def _tensor_table(data: mmap.mmap) -> list[TensorInfo]:
    magic, version, tensors, fields = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise KeyError(f"magic {magic!r}, version {version}")
    at = 24

    def skip(kind: int, count: int = 1) -> None:
        nonlocal at
        if kind == _STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", data, at)
                at += 8 + length
        elif kind == _ARRAY:
            for _ in range(count):
                inner, items = struct.unpack_from("<IQ", data, at)
                at += 12
                skip(inner, items)
        else:
            at += _VALUE_BYTES[kind] * count

    for _ in range(fields):
        skip(_STRING)  # the key
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        skip(kind)
    found = []
    for _ in range(tensors):
        (length,) = struct.unpack_from("<Q", data, at)
        name = bytes(data[at + 8 : at + 8 + length]).decode("utf-8")
        at += 8 + length
        (dims,) = struct.unpack_from("<I", data, at)
        shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
        ggml_type, _offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        found.append(TensorInfo(name, shape, ggml_type, math.prod(shape) // block * type_bytes))
    return found
