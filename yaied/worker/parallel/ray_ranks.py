"""A tensor-parallel Ray engine's ranks 1..N-1: Ray actors in the bundles of its placement group.

    EngineActor (bundle 0: rank 0, the engine)           RankActor (bundle r, any node)
    Worker -> TensorParallel.start(launcher) ----------->  Follower(spec): loads shard r
      store on 0.0.0.0:port, spec.host = this node's IP    thread: connect(host, port), serve
      wait_loaded() <------------- None or the error ----
      collectives (gloo on CPU, NCCL on CUDA) <--------->  the same forward, its own heads

The rank code is worker/parallel/rank.py's ``Follower``, as in a spawned rank process; only who
starts it and where differ. A rank lost with its node breaks rank 0's next collective (its
sockets close), which is fatal to the engine (worker/parallel/leader.py): the engine actor
exits and Ray restarts it, and the new life starts new ranks in the group's bundles, which Ray
has placed again on the nodes left. Ranks exit when rank 0 goes (their serve loop raises).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Any

from yaied.core.processes import match_niceness
from yaied.worker.parallel.rank import RankSpec

log = logging.getLogger(__name__)


class RankActor:
    """Wrapped by ``ray.remote`` in ``RayRankLauncher``: one rank, following rank 0 from a
    thread of its own, so ``wait_loaded`` can answer meanwhile."""

    def __init__(self, spec: RankSpec, niceness: int = 0) -> None:
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        problem = match_niceness(niceness)  # rank 0's priority, not Ray's nice 15 for workers
        if problem:
            log.warning("rank %d: %s", spec.rank, problem)
        self.spec = spec
        self._loaded = threading.Event()
        self._error: str | None = None
        threading.Thread(target=self._run, name=f"yaied-rank-{spec.rank}", daemon=True).start()

    def _run(self) -> None:
        from yaied.worker.parallel.rank import Follower  # torch starts here

        try:
            follower = Follower(self.spec)
        except BaseException as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            self._loaded.set()
            return
        self._loaded.set()
        code = 0
        try:
            follower.group.connect(self.spec.host, self.spec.port)
            follower.serve()
        except BaseException as exc:
            log.error("rank %d stopping: %s: %s", self.spec.rank, type(exc).__name__, exc)
            code = 1
        os._exit(code)  # rank 0 is gone or said stop: so is this actor (it is never restarted)

    def wait_loaded(self) -> str | None:
        """None once the shard is loaded, else why it was not."""
        self._loaded.wait()
        return self._error


@dataclasses.dataclass(slots=True)
class RayRank:
    """A rank actor, as rank 0's ``TensorParallel`` sees a rank (leader.py's ``Rank``)."""

    ray: Any
    actor: Any
    name: str
    pid: int | None = None

    def wait_loaded(self) -> None:
        try:
            error = self.ray.get(self.actor.wait_loaded.remote())
        except self.ray.exceptions.RayError as exc:
            error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if error is not None:
            raise RuntimeError(f"{self.name}: {error}")

    def exit_reason(self) -> str | None:
        return None  # asking Ray before every step costs a call; a lost rank breaks a collective

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(self.actor, no_restart=True)


class RayRankLauncher:
    """Starts rank r in bundle r of ``group``; ranks reach rank 0's store at this node's IP."""

    cores = False  # each rank keeps its own node's cores

    def __init__(self, group: Any, bundle: dict[str, float], niceness: int = 0) -> None:
        import ray

        self.ray = ray
        self.group = group
        self.bundle = bundle
        self.niceness = niceness
        self.host = ray.util.get_node_ip_address()

    def __call__(self, spec: RankSpec) -> RayRank:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if spec.device.startswith("cuda"):  # Ray shows each actor its own GPU as cuda:0
            spec = dataclasses.replace(spec, device="cuda:0")
        bundle = dict(self.bundle)
        options = {
            "num_cpus": bundle.pop("CPU", 0.0),
            "num_gpus": bundle.pop("GPU", 0.0),
            "resources": bundle,
            "max_restarts": 0,  # a lost rank ends the engine's life; the next life starts anew
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=spec.rank
            ),
        }
        actor = self.ray.remote(RankActor).options(**options).remote(spec, self.niceness)
        return RayRank(self.ray, actor, f"tensor-parallel rank {spec.rank} (ray)")
