"""Whether a start's local CPU engines fit this machine's cores and memory
(yaied/router/capacity.py), with the cores and the available memory injected."""

from __future__ import annotations

import logging

import pytest

from yaied.core.config import load_config
from yaied.core.host_memory import GIB, PROCESS_LEAST_BYTES, PROCESS_OVERHEAD_BYTES
from yaied.router.autoscale import AutoscaleConfig
from yaied.router.capacity import check_capacity
from yaied.router.config import EngineEntry, RouterConfig

CPU = load_config(overrides={"device.device": "cpu", "cache.kv_cache_gib": 2.0})
ONE = GIB + 2 * GIB + PROCESS_OVERHEAD_BYTES  # an engine: weights, its KV pool, a process
LEAST = GIB + 2 * GIB + PROCESS_LEAST_BYTES  # what it cannot run in less than: refused below


@pytest.fixture
def four_cores(monkeypatch):
    """--engines N's own count check (router/build.py) reads the cores itself."""
    from yaied.router import build

    monkeypatch.setattr(build, "usable_cores", lambda: 4)


def test_engines_past_the_memory_are_refused_naming_the_flags(four_cores):
    router = RouterConfig(engines=3)
    check_capacity(CPU, router, (), None, GIB, cores=4, available=3 * LEAST)
    with pytest.raises(ValueError, match=r"^router.engines \(--engines\) = 3: 3 CPU") as raised:
        check_capacity(CPU, router, (), None, GIB, cores=4, available=3 * LEAST - 1)
    assert "--kv-cache-gib" in str(raised.value) and "--engines" in str(raised.value)


def test_the_daemons_own_engine_is_checked_too():
    with pytest.raises(ValueError, match="^the engine: 1 CPU engine"):
        check_capacity(CPU, RouterConfig(), (), None, GIB, cores=4, available=LEAST - 1)


def test_little_headroom_is_a_warning(caplog, four_cores):
    with caplog.at_level(logging.WARNING, logger="yaied.router.capacity"):
        check_capacity(CPU, RouterConfig(engines=2), (), None, GIB, cores=4, available=2 * ONE)
    assert "leaving under 10%" in caplog.text


def test_gpu_and_remote_entries_are_not_counted():
    entries = (
        EngineEntry(device="cuda:0"),
        EngineEntry(kind="remote", url="http://10.0.0.2:8000"),
        EngineEntry(device="cpu", name="here"),
    )
    check_capacity(CPU, RouterConfig(), entries, None, GIB, cores=1, available=LEAST)
    with pytest.raises(ValueError, match=r"^\[\[engines\]\]: 1 CPU engine"):
        check_capacity(CPU, RouterConfig(), entries, None, GIB, cores=1, available=LEAST - 1)


def test_entries_threads_past_the_cores_are_refused():
    """[[engines]] entries set their own threads: two of 4 on 6 cores took turns."""
    entries = (EngineEntry(device="cpu", threads=4), EngineEntry(device="cpu", threads=4))
    with pytest.raises(ValueError) as raised:
        check_capacity(CPU, RouterConfig(), entries, None, 0, cores=6, available=None)
    assert str(raised.value) == (
        "2 local CPU engines need 8 cores (local-cpu: 4, local-cpu-2: 4: a core a rank, or the "
        "threads each sets), more than the 6 this daemon may use; lower engines.threads or run "
        "fewer engines"
    )
    check_capacity(CPU, RouterConfig(), entries, None, 0, cores=8, available=None)
    alone = (EngineEntry(device="cpu", threads=16),)  # one engine runs on what it is given
    check_capacity(CPU, RouterConfig(), alone, None, 0, cores=2, available=None)


def test_autoscale_max_engines_is_lowered_to_what_fits(caplog):
    """max_engines is a ceiling: above the cores or the memory, the autoscaler would spawn
    engines that take turns or meet the OOM killer. Lowered, with a warning."""
    scale = AutoscaleConfig(enabled=True, min_engines=1, max_engines=8)
    with caplog.at_level(logging.WARNING, logger="yaied.router.capacity"):
        by_cores = check_capacity(CPU, RouterConfig(), (), scale, GIB, cores=3, available=None)
        by_memory = check_capacity(CPU, RouterConfig(), (), scale, GIB, cores=64, available=5 * ONE)
    assert (by_cores.max_engines, by_memory.max_engines) == (3, 5)
    assert "autoscale.max_engines lowered from 8 to 3" in caplog.text
    roomy = check_capacity(CPU, RouterConfig(), (), scale, GIB, cores=64, available=64 * ONE)
    assert roomy == scale
    with pytest.raises(ValueError, match=r"autoscale.min_engines = 4 local engines do not fit"):
        check_capacity(
            CPU, RouterConfig(), (), AutoscaleConfig(enabled=True, min_engines=4), 0, cores=3
        )


def test_autoscale_min_engines_is_refused_only_where_they_cannot_fit_at_their_least(caplog):
    """The 1 GiB a process is an estimate: min_engines refused on it refused starts that run
    (2 engines at 2 x 3.25 GiB at their least, in 6.5 GiB). Past the estimate, a warning."""
    scale = AutoscaleConfig(enabled=True, min_engines=2, max_engines=4)
    with caplog.at_level(logging.WARNING, logger="yaied.router.capacity"):
        fits = check_capacity(CPU, RouterConfig(), (), scale, GIB, cores=8, available=2 * LEAST)
    assert (fits.min_engines, fits.max_engines) == (2, 2)
    assert "autoscale.max_engines lowered from 4 to 2" in caplog.text
    assert "as estimated), more than the 6.5 GiB available here" in caplog.text
    with pytest.raises(ValueError, match=r"min_engines = 2 local engines do not fit") as raised:
        check_capacity(CPU, RouterConfig(), (), scale, GIB, cores=8, available=2 * LEAST - 1)
    assert "6.5 GiB of memory, ~3.2 GiB a new engine at the least" in str(raised.value)


def test_the_max_engines_warning_names_no_memory_where_it_is_not_known(caplog):
    """It said "0.0 GiB of memory" where the available memory is not known (not Linux)."""
    scale = AutoscaleConfig(enabled=True, min_engines=1, max_engines=8)
    with caplog.at_level(logging.WARNING, logger="yaied.router.capacity"):
        check_capacity(CPU, RouterConfig(), (), scale, GIB, cores=3, available=None)
    assert "lowered from 8 to 3 local engines: what fits 3 cores (each new" in caplog.text
    assert "memory" not in caplog.text


def test_the_weights_least_refuses_and_their_expected_copies_warn(caplog):
    """(least, expected) weights, as the CLI estimates them: refused only below the least."""
    weights = (GIB, 3 * GIB)
    check_capacity(CPU, RouterConfig(), (), None, weights, cores=4, available=LEAST)
    with pytest.raises(ValueError, match="^the engine: 1 CPU engine"):
        check_capacity(CPU, RouterConfig(), (), None, weights, cores=4, available=LEAST - 1)
    with caplog.at_level(logging.WARNING, logger="yaied.router.capacity"):
        check_capacity(CPU, RouterConfig(), (), None, weights, cores=4, available=ONE)
    assert "weights ~3.0 GiB" in caplog.text and "more than the" in caplog.text


def test_each_engine_is_counted_with_its_own_ranks_weights():
    """The weights are a function of an engine's ranks: a TP=1 entry beside the config's TP=2
    counts one process's weights, the TP=2 engines their shards (and a KV pool a rank)."""
    tp2 = load_config(
        overrides={
            "device.device": "cpu",
            "cache.kv_cache_gib": 2.0,
            "engine.tensor_parallel_size": 2,
        }
    )
    asked = []

    def weights(ranks: int) -> int:
        asked.append(ranks)
        return {1: GIB, 2: 3 * GIB}[ranks]

    entries = (EngineEntry(device="cpu", tensor_parallel_size=1), EngineEntry(device="cpu"))
    least = LEAST + 3 * GIB + 2 * (2 * GIB + PROCESS_LEAST_BYTES)
    check_capacity(tp2, RouterConfig(), entries, None, weights, cores=8, available=least)
    with pytest.raises(ValueError, match=r"^\[\[engines\]\]: 2 CPU engine\(s\) need ~10\.8 GiB"):
        check_capacity(tp2, RouterConfig(), entries, None, weights, cores=8, available=least - 1)
    assert set(asked) == {1, 2}
