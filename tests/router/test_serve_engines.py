"""`yaied serve --engines N`: flags, errors, and a daemon with two engine processes."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.test_cli import assert_one_line_error, run_main
from tests.test_daemon import free_port, serve_command, wait_healthy


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--engines", "0"], r"router\.engines must be >= 1"),
        (["--router-policy", "random"], "--router-policy: invalid choice"),
    ],
)
def test_bad_router_flags(capsys, tiny_model_dirs, flags, pattern):
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), *flags]
    assert_one_line_error(*run_main(capsys, *argv), pattern)


def test_more_cpu_engines_than_cores_is_one_line_before_any_process_starts(
    capsys, tiny_model_dirs, monkeypatch
):
    """--engines had no upper bound: each engine is a process loading torch and the model,
    and past one per core they only take turns. Found before the socket opens and any process
    is spawned; exit 2 (a setting)."""
    from yaied import daemon
    from yaied.router import build, capacity, local_process

    monkeypatch.setattr(build, "usable_cores", lambda: 3)
    monkeypatch.setattr(capacity, "usable_cores", lambda: 3)
    spawned = []

    async def spawn(handle) -> None:
        spawned.append(handle.engine_id)
        raise RuntimeError("an engine process was spawned")

    monkeypatch.setattr(local_process.LocalProcessHandle, "_spawn", spawn)
    served = []  # the check runs before the socket opens, not as the app builds the engines
    monkeypatch.setattr(daemon, "run_server", lambda *args, **kwargs: served.append(args))
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--device", "cpu"]
    code, out, err = run_main(capsys, *argv, "--engines", "4", "--port", str(free_port()))
    assert (code, out, spawned, served) == (2, "", [], []), err
    assert err.splitlines()[-1] == (
        "yaied: error: 4 local CPU engines need 4 cores (local-cpu: 1, local-cpu-2: 1, "
        "local-cpu-3: 1, local-cpu-4: 1: a core a rank, or the threads each sets), more than "
        "the 3 this daemon may use; lower device.threads (--threads) or router.engines (--engines)"
    )
    assert len(build.local_entries(3, "cpu")) == 3  # one a core
    with pytest.raises(ValueError, match=r"^2 local CPU engines need 4 cores \(local-cpu: 2, "):
        build.local_entries(2, "cpu", tensor_parallel_size=2)


def test_engines_past_the_cores_by_their_threads_get_the_same_line_as_by_their_count(
    capsys, tiny_model_dirs, monkeypatch
):
    """--engines N on too few cores and --engines N --threads T past them were two rules and
    two lines (one naming --engines, the other "run fewer engines" for the same flag); an
    [[engines]] entry's threads are counted by the same rule. One line, exit 2, either way."""
    from yaied import daemon
    from yaied.router import build, capacity

    monkeypatch.setattr(build, "usable_cores", lambda: 3)
    monkeypatch.setattr(capacity, "usable_cores", lambda: 3)
    monkeypatch.setattr(daemon, "run_server", lambda *args, **kwargs: None)
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--device", "cpu"]
    argv += ["--port", str(free_port()), "--engines", "2"]
    code, out, err = run_main(capsys, *argv, "--threads", "2")
    assert (code, out) == (2, ""), err
    assert err.splitlines()[-1] == (
        "yaied: error: 2 local CPU engines need 4 cores (local-cpu: 2, local-cpu-2: 2: a core a "
        "rank, or the threads each sets), more than the 3 this daemon may use; lower "
        "device.threads (--threads) or router.engines (--engines)"
    )
    with pytest.raises(ValueError) as raised:  # the reload's and the daemon's own check
        build.local_entries(2, "cpu", threads=2)
    assert f"yaied: error: {raised.value}" == err.splitlines()[-1]
    assert run_main(capsys, *argv, "--threads", "1")[0] == 0


@pytest.mark.slow  # a daemon and two engine processes
@pytest.mark.timeout(240)
def test_serve_with_two_engine_processes(tiny_model_dirs, tmp_path):
    port = free_port()
    code = serve_command(tiny_model_dirs["llama"], port, "--engines", "2")
    log_path = tmp_path / "daemon.log"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
        try:
            # Room for two engine processes to spawn and load.
            wait_healthy(proc, base, log_path, timeout=150)
            engines = httpx.get(f"{base}/v1/engines").json()["data"]
            assert [(e["id"], e["kind"], e["health"]) for e in engines] == [
                ("0", "local", "up"),
                ("1", "local", "up"),
            ]
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "n": 2}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 6
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(timeout=30) == 0, log_path.read_text()
            finally:
                proc.kill()
    assert "2 engine(s) [0: local, 1: local]" in log_path.read_text()


@pytest.mark.slow  # a daemon and two engine processes
@pytest.mark.timeout(240)
def test_a_stop_after_engine_processes_leaves_no_leaked_semaphore_warning(tiny_model_dirs):
    """The resource tracker printed "There appear to be 2 leaked semaphore objects" at every
    exit of `yaied serve --engines 2` (tqdm's lock, made in each engine process, which ends by
    os._exit). Its stderr is read to the end: the pipe closes only once the daemon, its engine
    processes and the tracker, which writes its warning last, have all exited."""
    port = free_port()
    code = serve_command(tiny_model_dirs["llama"], port, "--engines", "2")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "yaied ready" in stderr, stderr
    assert "leaked semaphore" not in stderr, stderr


@pytest.mark.slow  # two engine processes start (and fail)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engines", ["1", "2"])
def test_an_engine_that_cannot_load_with_these_settings_is_one_line(tiny_model_dirs, engines):
    """A setting only the engine can judge (a KV pool too small for one context) stops the start
    with one line and exit 2, in engine processes as in the daemon's own: it was a traceback
    (the child's failure came back as a RuntimeError) and exit 1, after a logged traceback."""
    argv = ["--engines", engines, "--kv-cache-gib", "0.00001"]
    code = serve_command(tiny_model_dirs["llama"], free_port(), *argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("yaied: error: ") and "KV pool" in last, done.stderr


async def test_a_reload_counts_each_engines_ranks_against_the_cores(monkeypatch, caplog):
    """A SIGHUP reload made its local engines as if each had one rank: under tensor
    parallelism it let through more rank processes than cores, which the start refuses."""
    import dataclasses
    from types import SimpleNamespace

    from tests.router.test_manager import started
    from yaied.router import build
    from yaied.router.autoscale import AutoscaleConfig
    from yaied.server.config import ServerConfig
    from yaied.server.keys import KeyTable
    from yaied.server.reload import DaemonConfig, reload

    monkeypatch.setattr(build, "usable_cores", lambda: 3)
    manager, _ = await started(1)
    manager.engine_config = SimpleNamespace(
        engine=SimpleNamespace(tensor_parallel_size=2),
        device=SimpleNamespace(device="cpu", threads=0),
    )
    server = SimpleNamespace(
        manager=manager, draining=False, config=ServerConfig(), keys=KeyTable.parse(())
    )
    router = dataclasses.replace(manager.config, engines=2)
    config = DaemonConfig(ServerConfig(), router, (), AutoscaleConfig())
    before = sorted(manager.pool)
    with caplog.at_level("ERROR", logger="yaied.server.reload"):
        assert await reload(server, lambda: config)  # the keys apply; the engines do not
    assert "engines unchanged: 2 local CPU engines need 4 cores" in caplog.text
    assert sorted(manager.pool) == before
    await manager.stop()


def test_cpu_engines_past_the_memory_are_one_line_before_any_process_starts(
    capsys, tiny_model_dirs, monkeypatch
):
    """N engines of a KV pool and a copy of the weights each were not checked against the
    memory: past it the OOM killer ended one mid-serve, and systemd restarted it into the same
    end. Refused before the socket opens and any engine loads; exit 2 (a setting)."""
    from yaied import daemon
    from yaied.router import build, capacity

    monkeypatch.setattr(build, "usable_cores", lambda: 4)
    monkeypatch.setattr(capacity, "usable_cores", lambda: 4)
    monkeypatch.setattr(capacity, "available_bytes", lambda: 4 * 2**30)  # 2 x 2 GiB + more
    served = []
    monkeypatch.setattr(daemon, "run_server", lambda *args, **kwargs: served.append(args))
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--device", "cpu"]
    argv += ["--kv-cache-gib", "2", "--port", str(free_port())]
    code, out, err = run_main(capsys, *argv, "--engines", "2")
    assert (code, out, served) == (2, "", []), err
    last = err.splitlines()[-1]
    assert last.startswith("yaied: error: router.engines (--engines) = 2: 2 CPU engine(s) need")
    assert "more than the 4.0 GiB of memory available here" in last
    assert "lower cache.kv_cache_gib (--kv-cache-gib) or router.engines (--engines)" in last
    assert run_main(capsys, *argv, "--engines", "1")[0] == 0 and len(served) == 1


def test_each_cpu_engine_entrys_weights_are_counted_at_its_own_ranks(
    capsys, tiny_model_dirs, monkeypatch, tmp_path
):
    """The weights were estimated once, at engine.tensor_parallel_size (1 here), and counted so
    for every entry: a tensor-parallel entry, whose ranks keep float shards whatever the
    quantization, counted a quantized single process's bytes, and the start let through what
    the OOM killer would end. Each entry at its own ranks: refused, exit 2."""
    from yaied import daemon
    from yaied.router import build, capacity
    from yaied.worker import weight_bytes

    gib = 2**30
    asked = []

    def estimate(config, *, ranks=1, **_):
        asked.append(ranks)
        return weight_bytes.WeightBytes(gib, gib) if ranks == 1 else (4 * gib, 4 * gib)

    monkeypatch.setattr(weight_bytes, "estimate_weight_bytes", estimate)
    monkeypatch.setattr(build, "usable_cores", lambda: 8)
    monkeypatch.setattr(capacity, "usable_cores", lambda: 8)
    monkeypatch.setattr(capacity, "available_bytes", lambda: 8 * gib)
    served = []
    monkeypatch.setattr(daemon, "run_server", lambda *args, **kwargs: served.append(args))
    config = tmp_path / "yaied.toml"
    config.write_text(
        '[[engines]]\ndevice = "cpu"\nname = "one"\n\n'
        '[[engines]]\ndevice = "cpu"\nname = "two-ranks"\ntensor_parallel_size = 2\n'
    )
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--device", "cpu"]
    argv += ["--kv-cache-gib", "1", "--port", str(free_port()), "--config", str(config)]
    code, out, err = run_main(capsys, *argv)
    assert (code, out, served) == (2, "", []), err
    last = err.splitlines()[-1]
    # 1 + 1 + 0.25 GiB, and 4 + 2 x (1 + 0.25) GiB at the least: 8.75 GiB
    assert last.startswith("yaied: error: [[engines]]: 2 CPU engine(s) need ~8.8 GiB"), last
    assert "more than the 8.0 GiB of memory available here" in last
    assert sorted(set(asked)) == [1, 2]
