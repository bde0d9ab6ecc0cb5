"""The single in-process engine's health: a crashed loop is down and, unlike an engine process,
not coming back (nothing in the daemon restarts it), so /health says engine_dead for it."""

from __future__ import annotations

from types import SimpleNamespace

from yaied.router.handle import Health, InProcessHandle


def test_a_crashed_in_process_loop_is_down_and_not_coming_back():
    engine = SimpleNamespace(info=None, dead=None, step_observer=None)
    handle = InProcessHandle("0", engine)
    handle.health = Health.UP
    assert handle.health is Health.UP and handle.comes_back()
    engine.dead = RuntimeError("the step raised")
    assert handle.health is Health.DOWN and not handle.comes_back()
    handle.engine = None  # released: nothing left to come back
    assert not handle.comes_back()
