"""Configuration: frozen dataclasses from TOML, then the environment, then explicit overrides.

Precedence (later wins): the dataclass defaults (mirrored with comments in config/yaied.toml),
the TOML file, environment variables ``YAIED_<SECTION>_<KEY>`` (say ``YAIED_CACHE_PAGE_SIZE``),
and overrides from the command line or ``LLM(**kwargs)``. Values found at start-up (page count,
EOS ids) are never written back here; they travel in their own objects.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "auto", "gguf", "q8_0", "q4_0")
MAX_THREADS = 4096  # device.threads: above any machine's cores, below a process's thread limit
# scheduler.max_num_batched_tokens: a step's tokens. Prefill is cut into chunks of this budget, so
# no context needs more; a step of 2^20 tokens holds gigabytes of activations even on the default
# model. Past a few million rows oneDNN cannot lay out a linear layer's weights for the step
# (7.8M for a 152064x8192 LM head, 17.9M for an 8192->28672 MLP, torch 2.13), and every linear
# fell back to plain F.linear after a warning: the engine ran several times slower.
MAX_BATCHED_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = "smollm2-135m-instruct"  # HF folder, .gguf file, or the embedded default's name
    dtype: str = "auto"  # bf16 on GPUs and bf16-dot CPUs, else fp32 math over bf16 weights
    load_format: str = "auto"  # auto | dummy (random weights from the config, no tokenizer)
    max_model_len: int = 0  # 0 = the model's own context length
    model_impl: str = "auto"  # auto (native first) | native | transformers (its classes, our cache)
    trust_remote_code: bool = False  # never runs code shipped with a model unless set
    seed: int = 0  # seeds random weights of dummy models and unseeded sampling
    cache_dir: str = ""  # where converted GGUF models go; "" = $YAIED_CACHE_DIR or ~/.cache/yaied
    # none: linear weights dequantized (bf16/fp32) | gguf: a GGUF file's Q8_0/Q4_0/Q4_1,
    # Q2_K/Q3_K/Q4_K/Q5_K/Q6_K and IQ4_NL/IQ4_XS linears kept in their blocks (other types
    # dequantized) | auto: gguf for a GGUF model, else none | q8_0, q4_0: linears packed at load
    # (safetensors, dummy or GGUF); CPU, native only
    quantization: str = "none"

    def __post_init__(self) -> None:
        _one_of("model.dtype", self.dtype, DTYPES)
        _one_of("model.quantization", self.quantization, QUANTIZATIONS)
        _one_of("model.load_format", self.load_format, ("auto", "dummy"))
        _one_of("model.model_impl", self.model_impl, ("native", "transformers", "auto"))
        if self.dtype == "float16" and self.quantization not in ("none", "auto"):
            raise ValueError(
                f"model.quantization = {self.quantization} computes in float32 or bfloat16 "
                "(model.dtype = auto, float32 or bfloat16), not float16"
            )
        _at_least("model.max_model_len", self.max_model_len, 0)
        # torch's generators take 64 bits; past that the load failed with "Overflow when
        # unpacking long long", naming no setting (tensor-parallel ranks add their rank to it)
        if not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"model.seed must be an integer in [-2**63, 2**63), got {self.seed!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    kv_cache_gib: float = 1.0  # KV pool size on CPU
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights, activations, KV
    enable_prefix_caching: bool = True  # share KV pages of common prefixes between requests
    # The KV pools' dtype: auto (the math's), or bfloat16 pools under float32 math on CPU (half
    # the bytes a decode reads and the pool holds; yaied/worker/runner_setup.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _at_least("cache.page_size", self.page_size, 1)
        _one_of("cache.kv_cache_dtype", self.kv_cache_dtype, ("auto", "bfloat16", "float32"))
        if not 0 < self.kv_cache_gib < float("inf"):
            raise ValueError(
                f"cache.kv_cache_gib must be a finite number > 0, got {self.kv_cache_gib}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("cache.gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # most requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    policy: str = "fcfs"  # fcfs | priority | mlfq | plas (see yaied/engine/policy.py)
    # mlfq and plas: queues over attained service (seconds of model-execution time).
    num_queues: int = 8  # K queues; the last has no quantum
    base_quantum_s: float = 0.5  # the top queue's quantum
    quantum_growth: float = 2.0  # each queue's quantum is this times the one above
    starvation_beta: float = 4.0  # promote to the top when waited / ran >= this (inf: never)
    session_idle_expiry_s: float = 600.0  # forget a session idle this long

    def __post_init__(self) -> None:
        _at_least("scheduler.max_num_seqs", self.max_num_seqs, 1)
        _at_least("scheduler.max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens > MAX_BATCHED_TOKENS:
            raise ValueError(
                "scheduler.max_num_batched_tokens (--max-num-batched-tokens) must be at most "
                f"{MAX_BATCHED_TOKENS} (2^20), got {self.max_num_batched_tokens}"
            )
        _one_of("scheduler.policy", self.policy, ("fcfs", "priority", "mlfq", "plas"))
        _at_least("scheduler.num_queues", self.num_queues, 1)
        for name in ("base_quantum_s", "starvation_beta", "session_idle_expiry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"scheduler.{name} must be > 0, got {getattr(self, name)}")
        if not self.quantum_growth >= 1:
            raise ValueError(f"scheduler.quantum_growth must be >= 1, got {self.quantum_growth}")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = "auto"  # auto (cuda when present) | cpu | cuda | cuda:N
    threads: int = 0  # torch CPU threads; 0 = every core
    attention_backend: str = "auto"  # auto (triton on CUDA for native models, else torch)
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (triton backend on CUDA)

    def __post_init__(self) -> None:
        _one_of("device.attention_backend", self.attention_backend, ("auto", "triton", "torch"))
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(
                f"device.device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        _at_least("device.threads", self.threads, 0)
        if self.threads > MAX_THREADS:  # more threads than pthreads may start: OpenMP crashes
            raise ValueError(f"device.threads must be at most {MAX_THREADS}, got {self.threads}")


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The engine loop's fault handling (the [engine] section; see yaied/engine/step_loop.py)."""

    # A step running longer than this means a hung device or kernel: the engine stops, and its
    # process exits so that a supervisor restarts it. Far above any real step (CPU prefill of
    # a full budget, Triton's interpreter in tests), so it only ever catches a hang.
    step_timeout_s: float = 300.0
    max_failed_steps: int = 3  # whole steps failing in a row before the engine rebuilds its cache
    # Devices one engine spans (tensor parallelism, yaied/worker/parallel/): rank r runs on
    # cuda:(K + r) from device.device = cuda:K, or on its share of the cores on CPU.
    tensor_parallel_size: int = 1
    # Every row computes the same bits whatever else shares its step (yaied/worker/
    # batch_invariant.py): greedy output and logprobs do not depend on the load. CPU only;
    # slower (every projection on the few-row kernel, every decode on the prefill path).
    batch_invariant: bool = False
    # Schedule a decode step while the one before it runs on the device, its input tokens read
    # there (engine/lookahead.py): the device no longer waits for the host's work between
    # steps. auto: on CUDA (on CPU the host is the device: nothing to overlap); on: also on CPU
    # (the tests' way of running it); off: never. One tensor-parallel rank only.
    overlap_steps: str = "auto"

    def __post_init__(self) -> None:
        _one_of("engine.overlap_steps", self.overlap_steps, ("auto", "on", "off"))
        if not self.step_timeout_s > 0:
            raise ValueError(f"engine.step_timeout_s must be > 0, got {self.step_timeout_s}")
        _at_least("engine.max_failed_steps", self.max_failed_steps, 1)
        _at_least("engine.tensor_parallel_size", self.tensor_parallel_size, 1)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (the [speculative] section; see yaied/engine/speculative.py): draft
    tokens proposed without a second model, verified in one forward pass."""

    speculative_method: str = ""  # "" (off) | ngram (prompt lookup: copy what followed a match)
    num_speculative_tokens: int = 4  # the most draft tokens per sequence per step
    prompt_lookup_min: int = 2  # the shortest suffix n-gram that may propose drafts
    prompt_lookup_max: int = 4  # the longest suffix n-gram tried (longest first)
    # Steps with more running requests than this do not speculate: verifying drafts then costs
    # more than it saves (measured on a 2-core CPU, docs/benchmarks.md). 0: always speculate.
    speculative_max_batch_size: int = 16

    def __post_init__(self) -> None:
        _one_of("speculative.speculative_method", self.speculative_method, ("", "ngram"))
        _at_least("speculative.num_speculative_tokens", self.num_speculative_tokens, 1)
        _at_least("speculative.prompt_lookup_min", self.prompt_lookup_min, 1)
        _at_least("speculative.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        _at_least("speculative.speculative_max_batch_size", self.speculative_max_batch_size, 0)

    @property
    def enabled(self) -> bool:
        return self.speculative_method != ""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    engine: LoopConfig = field(default_factory=LoopConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        quantized = self.model.quantization not in ("none", "auto")
        if quantized and self.engine.tensor_parallel_size > 1:
            raise ValueError(
                f"model.quantization = {self.model.quantization} does not run with "
                "tensor parallelism (engine.tensor_parallel_size > 1); use one of them"
            )
        if self.engine.batch_invariant and self.speculative.enabled:
            raise ValueError("engine.batch_invariant does not run with speculative decoding")
        if self.engine.batch_invariant and self.engine.tensor_parallel_size > 1:
            raise ValueError("engine.batch_invariant does not run with tensor parallelism")


T = TypeVar("T")

# Sections of config/yaied.toml that other components (the daemon, the router) read.
OTHER_SECTIONS = ("server", "router", "engines", "autoscale")

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "engine": LoopConfig,
    "speculative": SpeculativeConfig,
}


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """Load the config; ``overrides`` keys are ``section.key`` or a key unique across sections."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if path is not None:
        for section, table in read_toml(path).items():
            if section in OTHER_SECTIONS:
                continue  # read by their own components
            if section not in SECTIONS:
                known = ", ".join([*SECTIONS, *OTHER_SECTIONS])
                raise ValueError(f"unknown config section [{section}] in {path}; known: {known}")
            for key, value in table.items():
                _field_type(section, key)  # rejects unknown keys
                values[section][key] = value
    env = os.environ if env is None else env
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            raw = env.get(f"YAIED_{section}_{f.name}".upper())
            if raw is not None:
                values[section][f.name] = _parse_env(section, f.name, raw)
    for dotted, value in (overrides or {}).items():
        section, key = _split_key(dotted)
        values[section][key] = value
    for section, table in values.items():
        for key, value in table.items():
            table[key] = _checked_type(section, key, value)
    built = {name: cls(**values[name]) for name, cls in SECTIONS.items()}
    return EngineConfig(**built)


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The parsed config file; no file is an empty one."""
    if path is None:
        return {}
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text: {exc}") from None
    for section, table in data.items():
        if section != "engines" and not isinstance(table, dict):
            raise ValueError(
                f"{path}: {section} = {table!r} is not a table; settings go under their "
                f"section, as [model] model = ..."
            )
    return data


def load_section(
    cls: type[T],
    section: str,
    data: Mapping[str, Any],
    env: Mapping[str, str] | None,
    overrides: Mapping[str, Any] | None,
) -> T:
    """One flat section read by its own component ([server], [router]): its table in ``data``
    (the parsed file, see read_toml), then
    ``YAIED_<SECTION>_<KEY>``, then ``overrides``; unknown keys and wrong types are a ValueError.
    A field's type is its default's; tuple fields take a TOML array or a comma-separated
    variable, so one variable can hold several API keys or origins."""
    values: dict[str, Any] = dict(data.get(section, {}))
    kinds = {f.name: type(f.default) for f in dataclasses.fields(cls)}
    env = os.environ if env is None else env
    for key, kind in kinds.items():
        name = f"YAIED_{section}_{key}".upper()
        if (raw := env.get(name)) is not None:
            values[key] = _parse_raw(name, kind, raw)
    values.update(overrides or {})
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise ValueError(f"unknown setting(s) {section}.{f', {section}.'.join(unknown)}")
    checked = {key: _of_kind(f"{section}.{key}", kinds[key], v) for key, v in values.items()}
    return cls(**checked)


def _split_key(dotted: str) -> tuple[str, str]:
    if "." in dotted:
        section, key = dotted.split(".", 1)
        _field_type(section, key)
        return section, key
    owners = [s for s, cls in SECTIONS.items() if dotted in _field_names(cls)]
    if len(owners) != 1:
        known = sorted(f"{s}.{n}" for s, cls in SECTIONS.items() for n in _field_names(cls))
        raise ValueError(f"unknown setting {dotted!r}; known settings: {', '.join(known)}")
    return owners[0], dotted


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _field_type(section: str, key: str) -> type:
    if section not in SECTIONS:
        raise ValueError(f"unknown config section {section!r}; known: {', '.join(SECTIONS)}")
    hints = get_type_hints(SECTIONS[section])
    if key not in hints:
        names = ", ".join(_field_names(SECTIONS[section]))
        raise ValueError(f"unknown setting {section}.{key}; known in [{section}]: {names}")
    return hints[key]


def _checked_type(section: str, key: str, value: Any) -> Any:
    return _of_kind(f"{section}.{key}", _field_type(section, key), value)


def _of_kind(name: str, kind: type, value: Any) -> Any:
    """A value of the field's type (ints are accepted for floats, lists for tuples), else a
    ValueError naming the setting."""
    if kind is tuple and isinstance(value, list | tuple):
        return tuple(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")


def _parse_env(section: str, key: str, raw: str) -> Any:
    return _parse_raw(f"YAIED_{section}_{key}".upper(), _field_type(section, key), raw)


def _parse_raw(name: str, kind: type, raw: str) -> Any:
    """An environment variable's text as a value of ``kind``, else a ValueError naming it."""
    try:
        if kind is tuple:
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:  # repr: an empty choice ("" = off) must show, not vanish
        choices = ", ".join(choice or repr(choice) for choice in allowed)
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
