"""Config loading: the shipped TOML mirrors the defaults; defaults < TOML < env < overrides."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import get_type_hints

import pytest

from yaied.core.config import SECTIONS, EngineConfig, load_config

SHIPPED_TOML = Path(__file__).resolve().parents[2] / "config" / "yaied.toml"


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "yaied.toml"
    path.write_text(text)
    return path


# -- config/yaied.toml ----------------------------------------------------------------------


def test_shipped_toml_equals_the_defaults():
    # env={} on both sides: a YAIED_* variable in the caller's shell must not mask a drift.
    assert load_config(SHIPPED_TOML, env={}) == load_config(env={}) == EngineConfig()


def test_shipped_toml_names_every_setting_with_its_type():
    data = tomllib.loads(SHIPPED_TOML.read_text())
    for section, cls in SECTIONS.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        assert sorted(data[section]) == sorted(fields), f"[{section}] differs from {cls.__name__}"
        hints = get_type_hints(cls)
        for key, value in data[section].items():
            # type(...) is, not isinstance: `kv_cache_gib = 1` (an int) would still compare equal.
            assert type(value) is hints[key], f"{section}.{key} = {value!r} is not {hints[key]}"


def test_shipped_toml_comments_every_setting():
    for line in SHIPPED_TOML.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, rest = line.partition("=")
            assert "#" in rest and rest.split("#", 1)[1].strip(), f"{key.strip()} has no comment"


# -- precedence -----------------------------------------------------------------------------


def test_defaults_without_file_env_or_overrides():
    config = load_config(env={})
    assert config.cache.page_size == 16
    assert config.cache.enable_prefix_caching is True
    assert config.model.model == "smollm2-135m-instruct"


def test_toml_over_defaults(tmp_path):
    path = write_toml(tmp_path, "[cache]\npage_size = 8\n[scheduler]\nmax_num_seqs = 4\n")
    config = load_config(path, env={})
    assert config.cache.page_size == 8
    assert config.scheduler.max_num_seqs == 4
    assert config.cache.kv_cache_gib == 1.0  # untouched keys keep their defaults


def test_env_over_toml(tmp_path):
    path = write_toml(tmp_path, "[cache]\npage_size = 8\nenable_prefix_caching = true\n")
    env = {"YAIED_CACHE_PAGE_SIZE": "32", "YAIED_CACHE_ENABLE_PREFIX_CACHING": "false"}
    config = load_config(path, env=env)
    assert config.cache.page_size == 32
    assert config.cache.enable_prefix_caching is False


def test_env_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("YAIED_SCHEDULER_MAX_NUM_SEQS", "3")
    assert load_config().scheduler.max_num_seqs == 3


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("Yes", True), ("on", True)]
    + [("0", False), ("false", False), ("NO", False), ("off", False)],
)
def test_env_booleans(raw, expected):
    config = load_config(env={"YAIED_CACHE_ENABLE_PREFIX_CACHING": raw})
    assert config.cache.enable_prefix_caching is expected


def test_env_float_and_string():
    env = {"YAIED_CACHE_KV_CACHE_GIB": "0.25", "YAIED_MODEL_DTYPE": "float32"}
    config = load_config(env=env)
    assert config.cache.kv_cache_gib == 0.25
    assert config.model.dtype == "float32"


def test_overrides_over_env_and_toml(tmp_path):
    path = write_toml(tmp_path, "[cache]\npage_size = 8\n")
    env = {"YAIED_CACHE_PAGE_SIZE": "32"}
    assert load_config(path, env=env, overrides={"cache.page_size": 64}).cache.page_size == 64
    assert load_config(path, env=env, overrides={"page_size": 4}).cache.page_size == 4


def test_dotted_and_bare_override_keys():
    config = load_config(env={}, overrides={"model.dtype": "float32", "max_num_seqs": 2})
    assert config.model.dtype == "float32"
    assert config.scheduler.max_num_seqs == 2


def test_other_components_sections_are_left_to_them(tmp_path):
    # [server] and [router] belong to the daemon and the router, which read them themselves.
    path = write_toml(tmp_path, "[server]\nport = 9000\n[cache]\npage_size = 8\n")
    assert load_config(path, env={}).cache.page_size == 8


# -- errors ---------------------------------------------------------------------------------


def test_unknown_key_in_toml(tmp_path):
    path = write_toml(tmp_path, "[cache]\npage_sise = 8\n")
    with pytest.raises(ValueError, match=r"unknown setting cache\.page_sise.*page_size"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        ("cache.page_sise", r"unknown setting cache\.page_sise"),
        ("bogus.page_size", r"unknown config section 'bogus'"),
        ("page_sise", r"unknown setting 'page_sise'.*cache\.page_size"),
    ],
)
def test_unknown_override_keys(key, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(env={}, overrides={key: 8})


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"YAIED_CACHE_ENABLE_PREFIX_CACHING": "maybe"}, "YAIED_CACHE_ENABLE_PREFIX_CACHING"),
        ({"YAIED_CACHE_PAGE_SIZE": "sixteen"}, r"YAIED_CACHE_PAGE_SIZE='sixteen'.*int"),
        ({"YAIED_CACHE_KV_CACHE_GIB": "lots"}, r"YAIED_CACHE_KV_CACHE_GIB.*float"),
    ],
)
def test_bad_env_values(env, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(env=env)


def test_unrelated_env_variables_are_ignored():
    assert load_config(env={"YAIED_CACHE_DIR": "/tmp/x", "YAIED_OTHER": "1"}) == EngineConfig()


@pytest.mark.parametrize(
    ("key", "value", "setting"),
    [
        ("cache.page_size", 0, "cache.page_size"),
        ("model.dtype", "int8", "model.dtype"),
        ("scheduler.policy", "x", "scheduler.policy"),
        ("model.load_format", "pickle", "model.load_format"),
        ("model.model_impl", "jax", "model.model_impl"),
        ("model.max_model_len", -1, "model.max_model_len"),
        ("cache.kv_cache_gib", 0.0, "cache.kv_cache_gib"),
        ("cache.gpu_memory_utilization", 1.5, "cache.gpu_memory_utilization"),
        ("scheduler.max_num_seqs", 0, "scheduler.max_num_seqs"),
        ("scheduler.max_num_batched_tokens", 0, "scheduler.max_num_batched_tokens"),
        ("device.device", "tpu", "device.device"),
        ("device.threads", -2, "device.threads"),
        ("device.threads", 100_000, "device.threads"),  # OpenMP's team would crash the process
        ("cache.kv_cache_gib", float("inf"), "cache.kv_cache_gib"),  # was int(nan) at load
        ("cache.kv_cache_gib", float("nan"), "cache.kv_cache_gib"),
        ("model.seed", 2**64, "model.seed"),  # was torch's "Overflow when unpacking long long"
        ("model.seed", -(2**63) - 1, "model.seed"),
    ],
)
def test_invalid_values_name_the_setting(key, value, setting):
    with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
        load_config(env={}, overrides={key: value})


def test_invalid_value_from_toml_names_the_setting(tmp_path):
    path = write_toml(tmp_path, '[model]\ndtype = "int8"\n')
    with pytest.raises(ValueError, match=r"model\.dtype"):
        load_config(path, env={})


def test_cuda_n_is_a_valid_device():
    assert load_config(env={}, overrides={"device": "cuda:1"}).device.device == "cuda:1"


# -- frozen ---------------------------------------------------------------------------------


def test_config_objects_are_frozen():
    config = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache = config.cache  # type: ignore[misc]
    for section in SECTIONS:
        part = getattr(config, section)
        name = dataclasses.fields(part)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, name, getattr(part, name))


def test_config_is_hashable_and_replace_validates():
    config = load_config(env={})
    assert hash(config) == hash(EngineConfig())
    with pytest.raises(ValueError, match=r"cache\.page_size"):
        dataclasses.replace(config.cache, page_size=0)


def test_wrong_types_are_value_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[cache]\nenable_prefix_caching = "no"\n')
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        load_config(path)
    with pytest.raises(ValueError, match="max_num_seqs must be a int"):
        load_config(overrides={"max_num_seqs": True})
    assert load_config(overrides={"kv_cache_gib": 2}).cache.kv_cache_gib == 2.0


def test_unknown_section_is_rejected_but_component_sections_pass(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[schedular]\nmax_num_seqs = 4\n")
    with pytest.raises(ValueError, match=r"unknown config section \[schedular\]"):
        load_config(path)
    path.write_text('[server]\nhost = "0.0.0.0"\n')
    assert load_config(path) == load_config()


@pytest.mark.parametrize("text", ['model = "x"\n', 'server = "x"\n', "router = 5\n", "foo = 1\n"])
def test_a_section_that_is_not_a_table_is_one_clear_error(tmp_path, text):
    # load_config used to fail on str.items() (AttributeError, a traceback from the CLI).
    path = write_toml(tmp_path, text)
    with pytest.raises(ValueError, match=r"yaied\.toml: .* is not a table; settings go under"):
        load_config(path, env={})


def test_a_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "yaied.toml"
    path.write_bytes(b"\x00\xff\xfe")
    with pytest.raises(ValueError, match=r"yaied\.toml is not UTF-8 text"):
        load_config(path, env={})


def test_an_empty_choice_shows_in_the_message():
    # "" (off) is one of speculative_method's choices; joined bare, it read "one of , ngram"
    with pytest.raises(ValueError, match=r"must be one of '', ngram; got 'foo'"):
        load_config(env={}, overrides={"speculative.speculative_method": "foo"})
