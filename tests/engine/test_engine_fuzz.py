"""The stateful engine fuzzer (tests/engine/engine_fuzz.py) in a derandomized profile: the same
examples every run, in well under a minute and a half on two cores. scripts/fuzz_engine.py runs
it with fresh seeds for as long as asked."""

from __future__ import annotations

import importlib
import sys

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from tests.engine.engine_fuzz import (
    COVERAGE,
    EOS,
    FuzzFailure,
    FuzzSetup,
    FuzzWorld,
    build_model_folder,
    check_pages,
    fuzz_settings,
    loose_tokens,
    near_tie,
    run,
    run_machine,
    scripted_example,
    segment_runs,
    specs,
    step,
    submit,
)
from yaied.core.request import SamplingParams, TokenLogprobs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = FuzzWorld(build_model_folder(tmp_path_factory.mktemp("fuzz-model")))
    yield world
    world.close()


def test_engine_fuzz(world):
    # The checks check little unless the profile reaches what they are meant to check: a scripted
    # example makes each kind of event happen whatever hypothesis draws (generation alone once
    # aborted no waiting request in 122 examples).
    scripted_example(world)
    missing = [what for what in COVERAGE if not world.stats[what]]
    assert not missing, f"the scripted example did not reach {missing}"
    run(world, fuzz_settings(derandomize=True, max_examples=110, stateful_step_count=50))
    print(dict(sorted(world.stats.items())))


def test_engine_fuzz_with_speculative_decoding(tmp_path_factory):
    """The same invariants with n-gram drafts in every step: greedy and seeded outputs still
    equal the request run alone without speculation, pages still all come back."""
    folder = build_model_folder(tmp_path_factory.mktemp("fuzz-spec-model"), std=0.08)
    world = FuzzWorld(folder, FuzzSetup(num_speculative_tokens=3))
    try:
        scripted_example(world)
        missing = [what for what in COVERAGE if not world.stats[what]]
        assert not missing, f"the scripted example did not reach {missing}"
        run(world, fuzz_settings(derandomize=True, max_examples=80, stateful_step_count=40))
        print(dict(sorted(world.stats.items())), world.engine.stats())
        spec = world.engine.stats()
        # The workload is random and its mix follows the engine's timing (CI's run accepted 19%,
        # one alone 30%): the bound says drafts do get accepted; a broken verifier takes ~none.
        assert spec["spec_decode_num_accepted_tokens"] > 0.1 * spec["spec_decode_num_draft_tokens"]
    finally:
        world.close()


def fail(message, tracked=None):
    raise FuzzFailure(message)


def test_the_page_check_sees_a_page_owned_twice(world):
    engine = world._new_engine()
    try:
        submit(engine, list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0))
        step(engine)
        check_pages(engine, fail)
        request = engine.scheduler.running[0]
        engine.pool.free([request.page_ids[-1]])  # free, and still the request's
        with pytest.raises(FuzzFailure, match="is both"):
            check_pages(engine, fail)
    finally:
        engine._executor.shutdown(wait=False)


def test_near_tie_leaves_out_what_min_tokens_bans():
    lp = TokenLogprobs(7, -1.0, [EOS, 7, 9], [-0.5, -1.0, -1.00001])
    gap, pair = near_tie(lp, SamplingParams(temperature=0.0), 0)
    assert gap == pytest.approx(0.5) and pair == {EOS, 7}
    gap, pair = near_tie(lp, SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4), 1)
    assert gap == pytest.approx(1e-5) and pair == {7, 9}


class _DrawProbe(RuleBasedStateMachine):
    """Draws what the fuzzer's rules draw, and nothing else; keeps the draws."""

    drawn: list = []

    @rule(runs=segment_runs, loose=loose_tokens, spec=specs)
    def submit(self, runs, loose, spec) -> None:
        self.drawn.append((runs, loose, spec))

    @rule(n=st.integers(1, 12), group=st.booleans())
    def step(self, n, group) -> None:
        self.drawn.append((n, group))


def _probe_draws() -> list:
    _DrawProbe.drawn = []
    fuzz = fuzz_settings(derandomize=True, max_examples=60, stateful_step_count=20)
    run_machine(_DrawProbe, fuzz)
    return _DrawProbe.drawn


def test_the_derandomized_draws_do_not_depend_on_what_was_imported_before(tmp_path, monkeypatch):
    """Hypothesis also draws literal constants of the local modules imported so far: the fuzzer
    drew other examples after tests/engine/test_simulator.py had imported sim_workloads (and,
    that time, no abort of a waiting request). A module of new constants, imported between two
    runs, must change nothing."""
    providers = pytest.importorskip("hypothesis.internal.conjecture.providers")
    if not hasattr(providers, "_get_local_constants"):
        pytest.skip("this Hypothesis draws no local constants")
    # The probe module's constants must not reach the rest of the session's hypothesis tests.
    for name in ("_local_constants", "_sys_modules_len"):
        monkeypatch.setattr(providers, name, getattr(providers, name))
    monkeypatch.setattr(providers, "_seen_modules", set(providers._seen_modules))
    before = _probe_draws()
    source = "FLOATS = (0.015625, 0.1, 0.25, 0.3, 0.75, 0.9)\nINTS = (3, 7, 17, 33, 250, 999)\n"
    (tmp_path / "fuzz_constants_probe.py").write_text(source)
    monkeypatch.syspath_prepend(tmp_path)
    try:
        importlib.import_module("fuzz_constants_probe")
        after = _probe_draws()
    finally:
        sys.modules.pop("fuzz_constants_probe", None)
        providers.CONSTANTS_CACHE.cache.clear()
    assert len(before) > 500
    assert after == before
