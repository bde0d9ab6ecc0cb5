"""An engine placed by Ray: a Ray actor running the engine (router/ray_actor.py), reached
through Ray calls rather than a second HTTP hop. To the manager it is one more EngineHandle, so
routing, session pins, PLAS, cancel and the KV coordinator do not know the difference.

    RayHandle (router's event loop)                      EngineActor (a node Ray picked)
    start:  actor created (its resources; the node label; for a tensor-parallel engine a
            placement group of N bundles, ``placement_strategy``: the actor is rank 0 in
            bundle 0, its ranks are actors in the others, worker/parallel/ray_ranks.py)
            -> await actor.load() -> UP
    events: a thread reads actor.events() (streaming) <--- every call's events, a list per
            few steps; stats every 0.2 s -> on the loop: each event to its call's sink, stats(),
            the step observer (a task watches the stream's silence)
    submit: actor.submit(...)  ------------------------->  engine.add_request
    abort:  actor.abort(id)    ------------------------->  engine.abort

Loss. The event stream raising a Ray error (the actor died, its node left) or falling silent
past ``router.remote_read_timeout_seconds`` means the engine is lost: every call in flight is told
``sink.lost`` (the manager moves them to another engine, as for a dead local process),
pins go (``on_lost``), and the handle is DOWN until ``load`` answers again. Ray restarts the
actor itself (``max_restarts``) on any node that can hold it, the nodes left included; one
Ray has given up on is created anew here, after a backoff that doubles. With no node left the
call to ``load`` waits until one returns, and the daemon answers 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from yaied.core.config import EngineConfig
from yaied.core.request import SamplingParams, TokenEvent
from yaied.router.config import EngineEntry, RouterConfig
from yaied.router.handle import CallSink, EngineHandle, EngineUnavailable, Health, Stats
from yaied.router.ray_actor import EngineActor
from yaied.router.ray_cluster import check_feasible, connect, engine_bundle, engine_threads

log = logging.getLogger(__name__)
_MAX_CONCURRENCY = 1000  # actor calls running at once (submits, aborts, the stream)


class RayHandle(EngineHandle):
    kind = "ray"
    resumes = True  # the actor's engine resumes a moved call after its sent tokens

    def __init__(
        self,
        engine_id: str,
        entry: EngineEntry,
        engine_config: EngineConfig,
        router_config: RouterConfig,
    ) -> None:
        super().__init__(engine_id)
        self.entry = entry
        self.router_config = router_config
        self.world_size = entry.tensor_parallel_size or engine_config.engine.tensor_parallel_size
        self.ray = connect(router_config.ray_address)  # a ValueError stops the start here
        check_feasible(self.ray, entry, self.world_size)
        self.engine_config = self._engine_config(engine_config)
        self.num_restarts = 0
        self.node_id: str | None = None
        self._actor: Any = None
        self._group: Any = None  # the placement group of a tensor-parallel engine
        self._sinks: dict[str, CallSink] = {}
        self._stats: Stats | None = None
        self._stopping = False
        self._watch: asyncio.Task | None = None  # watches the event stream
        self._stream_gen = 0  # items of older streams (an earlier life) are dropped
        self._last_item = 0.0
        self._revive: asyncio.Task | None = None

    def _engine_config(self, config: EngineConfig) -> EngineConfig:
        bundle = engine_bundle(self.entry)
        device = "cuda" if bundle.get("GPU", 0) > 0 else "cpu"
        if self.entry.device != "auto":
            device = self.entry.device
        threads = engine_threads(self.entry) * self.world_size
        return dataclasses.replace(
            config,
            device=dataclasses.replace(config.device, device=device, threads=threads),
            engine=dataclasses.replace(config.engine, tensor_parallel_size=self.world_size),
        )

    # -- the actor's life --------------------------------------------------------------------

    def _create_actor(self) -> None:
        ray, bundle = self.ray, engine_bundle(self.entry)
        options: dict[str, Any] = {
            "max_restarts": self.entry.max_restarts,
            "max_task_retries": 0,  # a call is never run twice: the manager decides retries
            "max_concurrency": _MAX_CONCURRENCY,
        }
        if self.world_size > 1:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundles = [dict(bundle) for _ in range(self.world_size)]
            self._group = placement_group(bundles, strategy=self.entry.placement_strategy)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=0
            )
        options["num_cpus"] = bundle.pop("CPU", 0.0)
        options["num_gpus"] = bundle.pop("GPU", 0.0)
        options["resources"] = bundle
        # Rank 0's threads (device.threads counts every rank's), set by the actor before torch
        # loads: no runtime_env, so Ray may hand the actor a worker process it started already.
        threads = engine_threads(self.entry)
        remote = ray.remote(EngineActor).options(**options)
        rank_bundle = engine_bundle(self.entry)
        self._actor = remote.remote(
            self.engine_id,
            self.engine_config,
            threads,
            self._group,
            rank_bundle,
            os.getpriority(os.PRIO_PROCESS, 0),  # the engine's priority: the daemon's own
        )

    async def start(self) -> None:
        self._stopping = False
        self.health = Health.STARTING
        self._create_actor()
        await self._load()
        self._watch = asyncio.get_running_loop().create_task(self._read_events())

    async def _load(self) -> None:
        """Wait for the actor to be placed and its engine built (a restarted actor builds a
        new one); raises what the load raised."""
        try:
            self.info = await self._actor.load.remote()
            self.node_id = await self._actor.node_id.remote()
        except self.ray.exceptions.RayTaskError as exc:
            raise RuntimeError(f"engine {self.engine_id}: {exc.cause or exc}") from None
        self.health = Health.UP
        log.info("engine %s: ray actor up on node %s", self.engine_id, self.node_id)

    async def _read_events(self) -> None:
        """The actor's one event stream, for as long as it lives, read by a thread of its own
        (one hop onto the loop per item, as a local engine's event pipe): each call's events
        to its sink, the stats to ``stats()`` and the step observer. A Ray error on it, or a
        silence past the read timeout (the stats come every 0.2 s), means the engine was lost."""
        loop = asyncio.get_running_loop()
        self._stream_gen += 1
        stream = self._actor.events.options(num_returns="streaming").remote()
        ended: asyncio.Future[BaseException] = loop.create_future()
        self._last_item = loop.time()
        args = (stream, loop, ended, self._stream_gen)
        name = f"yaied-ray-events-{self.engine_id}"
        threading.Thread(target=self._pump, args=args, name=name, daemon=True).start()
        timeout = self.router_config.remote_read_timeout_seconds
        while not ended.done():
            await asyncio.wait([ended], timeout=1.0)
            if not ended.done() and loop.time() - self._last_item > timeout:
                ended.set_result(TimeoutError(f"no word for {timeout:.0f} s"))
        self._engine_lost(f"engine {self.engine_id} (ray) was lost: {_brief(ended.result())}")

    def _pump(self, stream: Any, loop: asyncio.AbstractEventLoop, ended: Any, gen: int) -> None:
        """The reader thread: each item onto the loop; an error or the end, to ``ended``."""
        reason: BaseException = EOFError("the event stream ended")
        try:
            for ref in stream:
                loop.call_soon_threadsafe(self._on_item, gen, self.ray.get(ref))
        except Exception as exc:
            reason = exc
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody to tell
            loop.call_soon_threadsafe(_settle, ended, reason)

    def _on_item(self, gen: int, item: tuple[list[TokenEvent], Stats | None, list[int]]) -> None:
        if gen != self._stream_gen:
            return  # from a stream of an earlier life
        self._last_item = asyncio.get_running_loop().time()
        events, stats, steps = item
        for event in events:
            self._deliver(event)
        if stats is not None:
            self._stats = stats
        if self.step_observer is not None:
            for num_tokens in steps:
                self.step_observer(self.engine_id, num_tokens)

    def _deliver(self, event: TokenEvent) -> None:
        sink = self._sinks.get(event.request_id)
        if sink is not None:
            if event.finished:
                del self._sinks[event.request_id]
            sink.deliver(event)

    def _engine_lost(self, reason: str) -> None:
        """Every call in flight is lost; the engine is DOWN until its actor answers again."""
        if self.health is not Health.UP or self._stopping:
            return
        self.health = Health.DOWN
        self._stats = None
        lost, self._sinks = self._sinks, {}
        log.error("%s; %d calls in flight move to other engines or end", reason, len(lost))
        for sink in lost.values():
            sink.lost(reason)
        self._lost()
        self._revive = asyncio.get_running_loop().create_task(self._come_back())

    async def _come_back(self) -> None:
        """Wait for Ray's restart of the actor (on whichever node can hold it, whenever one
        can); an actor Ray gave up on is created anew, after a backoff that doubles."""
        config, failures = self.router_config, 0
        while not self._stopping:
            try:
                await self._load()
            except (self.ray.exceptions.RayError, RuntimeError) as exc:
                failures += 1
                delay = config.restart_backoff_seconds * 2 ** (failures - 1)
                delay = min(delay, config.max_restart_backoff_seconds)
                log.warning("engine %s: not back (%s); again in %.1f s", self.engine_id, exc, delay)
                await asyncio.sleep(delay)
                if isinstance(exc, self.ray.exceptions.ActorDiedError):
                    self._kill()
                    self._create_actor()
                continue
            self.num_restarts += 1
            self._watch = asyncio.get_running_loop().create_task(self._read_events())
            return

    async def stop(self, timeout: float = 15.0) -> None:
        """Ask the actor to abort its calls and stop its engine, up to ``timeout`` less a
        second, then kill it (no restart) and free its placement group."""
        self._stopping = True
        if self._revive is not None:
            self._revive.cancel()
        if self._actor is not None and self.health is Health.UP:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + max(0.0, timeout - 1.0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._actor.shutdown.remote(), deadline - loop.time())
            while self._sinks and loop.time() < deadline:  # the final events, on their way
                await asyncio.sleep(0.01)
        if self._watch is not None:
            self._watch.cancel()
        self._kill()
        self.health = Health.STOPPED

    def _kill(self) -> None:
        if self._actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(self._actor, no_restart=True)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None

    # -- calls ------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None,
        priority: int,
        sink: CallSink,
        output_ids: Sequence[int] = (),
    ) -> None:
        if self.health is not Health.UP or self._actor is None:
            raise EngineUnavailable(f"engine {self.engine_id} is {self.health.value}")
        self._sinks[request_id] = sink
        self._actor.submit.remote(
            request_id, prompt_ids, params, session_id, priority, list(output_ids)
        )

    async def abort(self, request_id: str) -> None:
        if request_id in self._sinks and self._actor is not None:
            self._actor.abort.remote(request_id)  # its final event comes on the event stream

    def stats(self) -> Stats | None:
        return self._stats

    def describe(self) -> dict[str, Any]:
        return {
            "node": self.entry.node or None,
            "node_id": self.node_id,
            "resources": engine_bundle(self.entry),
            "restarts": self.num_restarts,
            "tensor_parallel_size": self.world_size,
        }


def _settle(future: asyncio.Future, reason: BaseException) -> None:
    if not future.done():
        future.set_result(reason)


def _brief(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]
