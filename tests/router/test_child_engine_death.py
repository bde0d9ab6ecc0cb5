"""An engine process whose engine stops for good (here: a step that hangs past
engine.step_timeout_s) tells the router every call is lost (the router moves them elsewhere)
and exits non-zero, so the router sees its pipe close and starts a new process
(test_manager/test_integration cover the restart), instead of staying alive with a dead loop
and taking more calls."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from yaied.core.config import load_config
from yaied.core.request import SamplingParams
from yaied.router.child import EXIT_ENGINE_DEAD, ChildSpec, child_main


def hanging_child_main(spec, submit_conn, abort_conn, event_conn) -> None:
    """child_main with a worker whose steps hang (patched in the child, after spawn)."""
    from yaied.worker.worker import Worker

    execute = Worker.execute

    def hanging(self, batch):
        time.sleep(30)
        return execute(self, batch)

    Worker.execute = hanging
    child_main(spec, submit_conn, abort_conn, event_conn)


@pytest.mark.timeout(120)
def test_an_engine_process_exits_when_its_engine_dies(tiny_model_dirs):
    config = load_config(
        env={},
        overrides={
            "model": str(tiny_model_dirs["llama"]),
            "kv_cache_gib": 0.01,
            "threads": 1,
            "step_timeout_s": 0.5,
        },
    )
    ctx = multiprocessing.get_context("spawn")
    submit_r, submit_w = ctx.Pipe(duplex=False)
    abort_r, abort_w = ctx.Pipe(duplex=False)
    event_r, event_w = ctx.Pipe(duplex=False)
    spec = ChildSpec("0", config, visible_device=None, threads=1)
    proc = ctx.Process(target=hanging_child_main, args=(spec, submit_r, abort_r, event_w))
    proc.start()
    try:
        assert event_r.poll(90) and event_r.recv()[0] == "ready"
        params = SamplingParams(max_tokens=2, temperature=0.0)
        submit_w.send(("submit", "call-1", [1, 2, 3], params, None, 0, ()))
        finals = []
        deadline = time.monotonic() + 30
        while not finals and time.monotonic() < deadline:
            if event_r.poll(1):
                message = event_r.recv()
                if message[0] == "lost" or (message[0] == "event" and message[1].finished):
                    finals.append(message)
        assert finals and finals[0][:2] == ("lost", "call-1")
        assert "step_timeout_s" in finals[0][2]
        proc.join(20)  # well before the hung step's 30 s
        assert proc.exitcode == EXIT_ENGINE_DEAD
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
