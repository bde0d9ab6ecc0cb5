"""How an engine's tensor-parallel ranks 1..N-1 start, for the layers above the engine (which
do not import the worker): as processes of the engine's own (the default: pass nothing), or as
Ray actors in the bundles of a placement group (``ray_rank_launcher``, for router/ray_actor.py).
``AsyncEngine(config, rank_launcher=...)`` takes either."""

from __future__ import annotations

from typing import Any

from yaied.worker.parallel.leader import RankLauncher


def ray_rank_launcher(group: Any, bundle: dict[str, float], niceness: int = 0) -> RankLauncher:
    """Ranks as Ray actors: rank r in bundle r of ``group``, each holding ``bundle``, running at
    ``niceness`` (the daemon's), not at Ray's nice 15 for workers."""
    from yaied.worker.parallel.ray_ranks import RayRankLauncher  # imports Ray

    return RayRankLauncher(group, bundle, niceness)
