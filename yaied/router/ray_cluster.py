"""Joining a Ray cluster, and what Ray needs to place one engine: its bundle of resources.

Ray is optional (``pip install "yaied[ray]"``): nothing imports it until a ``kind = "ray"``
engine exists, and every way it can be missing or unreachable is a ValueError of one line,
which stops the start (the CLI prints it) or refuses ``POST /v1/engines`` (a 400). A cluster
that does not answer, or has no node for an engine now, may yet (its head restarting, its nodes
joining after a reboot, Ray's autoscaler adding one): that one is an UnreachableError, a
ValueError on which the start exits 1, which systemd retries, rather than 2 (a setting to fix).
An engine whose resources exceed the total of every node the cluster has or may add (a GPU on
a cluster without one, more CPUs than any node has) is such a setting, exit 2 (``never_fits``),
where the nodes that may come are known: the Ray instance started here, or a cluster whose
autoscaler config lists its node types.

    router.ray_address   ""         a Ray instance started here, sized to this machine
                         "auto"     the cluster this machine already belongs to (`ray start`)
                         HOST:PORT  that cluster's GCS; checked with a plain connect first, since
                                    ray.init retries an address that does not answer for minutes
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterable
from typing import Any

from yaied.core.errors import UnreachableError
from yaied.router.config import EngineEntry

log = logging.getLogger(__name__)
NODE_LABEL_AMOUNT = 0.001  # what an engine takes of its node's label resource: any node has 1
_CONNECT_TIMEOUT_SECONDS = 5.0
_JOIN_LOCK = threading.Lock()
_own_instance: str | None = None  # the GCS address of the Ray instance this process started


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError('kind = "ray" engines need Ray: pip install "yaied[ray]"') from None
    return ray


def connect(address: str) -> Any:
    """Join the cluster at ``address`` once per process (see the module's table); returns the
    ``ray`` module. Threads may join at once (``join_for`` from an HTTP add, a reload and the
    autoscaler): the lock lets one of them start Ray and the others find it started."""
    ray = import_ray()
    with _JOIN_LOCK:
        if ray.is_initialized():
            return ray
        return _join(ray, address)


def _join(ray: Any, address: str) -> Any:
    if address not in ("", "auto") and not address.startswith("ray://"):
        _check_reachable(address)
    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(
                address="local",
                include_dashboard=False,
                logging_level=logging.WARNING,
                # Ray's workers run at nice 15 unless told; engines run at the daemon's
                # priority (the actors also set it themselves, where a joined cluster's
                # nodes were started without this).
                _system_config={"worker_niceness": 0},
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local Ray instance"
        error = UnreachableError if isinstance(exc, ConnectionError) else ValueError
        raise error(f"cannot join the Ray cluster ({where}): {_one_line(exc)}") from None
    log.info("ray: joined %s", address or "a Ray instance started here")
    if not address:
        global _own_instance
        _own_instance = _gcs_address(ray)
    return ray


def _gcs_address(ray: Any) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 (not connected, or a Ray without it: not known)
        return None


def _started_here(ray: Any) -> bool:
    """Whether the Ray instance this process is connected to is the one it started (not a
    cluster joined since, as a test's: hence the address, not a flag)."""
    return _own_instance is not None and _gcs_address(ray) == _own_instance


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdecimal():
        raise ValueError(f"--ray-address must be auto or HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_SECONDS).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UnreachableError(f"cannot reach the Ray cluster at {address}: {reason}") from None


def engine_bundle(entry: EngineEntry) -> dict[str, float]:
    """What one rank of the engine holds on its node: the entry's resources ({CPU: 1} when it
    names none), plus a sliver of the node label's custom resource when it names a node."""
    bundle = dict(entry.resources) or {"CPU": 1.0}
    if entry.node:
        bundle[entry.node] = NODE_LABEL_AMOUNT
    return bundle


def engine_threads(entry: EngineEntry) -> int:
    """Torch threads of a CPU engine: the entry's own, else the CPUs its bundle holds."""
    return entry.threads or max(1, int(dict(entry.resources).get("CPU", 1.0)))


def check_feasible(ray: Any, entry: EngineEntry, world_size: int) -> None:
    """A ValueError unless the live nodes could hold the engine, resources in use or not (a
    busy cluster only makes the engine wait): one bundle per rank, all on one node under
    STRICT_PACK (or with one rank), each on a node of its own under STRICT_SPREAD. An
    UnreachableError (exit 1 at a start: retried) where nodes may yet come that hold it, else
    a plain one (exit 2: a setting), see ``never_fits``."""
    bundle = engine_bundle(entry)
    known = ray.nodes()
    nodes = [n for n in known if n.get("Alive")]
    fits = [n for n in nodes if _holds(n, bundle, 1)]
    if world_size == 1 or entry.placement_strategy == "STRICT_PACK":
        if any(_holds(n, bundle, world_size) for n in nodes):
            return
    elif entry.placement_strategy == "STRICT_SPREAD":
        if len(fits) >= world_size:
            return
    elif sum(_copies(n, bundle) for n in fits) >= world_size:
        return
    need = {k: (v if k == entry.node else v * world_size) for k, v in bundle.items()}
    how = "" if world_size == 1 else f" ({world_size} ranks, {entry.placement_strategy})"
    listing = "; ".join(_node_summary(n) for n in nodes) or "none alive"
    line = f"no Ray node can hold an engine of {_format(need)}{how} (nodes: {listing})"
    types = _autoscaler_node_types(ray)
    if types is not None and never_fits(known, types, entry, world_size):
        ranks = " or engines.tensor_parallel_size" if world_size > 1 else ""
        raise ValueError(
            f"{line}: more than any node{' labelled ' + entry.node if entry.node else ''} has "
            f"in total, or a node type of Ray's autoscaler would; lower engines.resources{ranks}"
        )
    raise UnreachableError(line)


def never_fits(
    nodes: list[dict[str, Any]],
    node_types: list[dict[str, float]],
    entry: EngineEntry,
    world_size: int,
) -> bool:
    """Whether no node the cluster has or may have could ever hold the engine, however idle:
    its bundle (``world_size`` of them on one node under STRICT_PACK or with one rank, else
    one) exceeds the total resources of every node, alive or dead (a node that left may
    return), and of every node type Ray's autoscaler may add (``node_types``: their
    resources). With ``entry.node``, only the nodes labelled so count, and none alive or known
    with that label is not "never": that node may join (a reboot). None alive: the cluster may
    yet come up. Called only where the nodes that may come are known (``node_types`` not
    None: see ``_autoscaler_node_types``)."""
    if not any(n.get("Alive") for n in nodes):
        return False
    hosts = [n.get("Resources", {}) for n in nodes] + list(node_types)
    if entry.node:
        hosts = [h for h in hosts if h.get(entry.node, 0.0) > 0]
        if not any(n.get("Alive") and n.get("Resources", {}).get(entry.node) for n in nodes):
            return False
    base = dict(entry.resources) or {"CPU": 1.0}
    copies = world_size if world_size == 1 or entry.placement_strategy == "STRICT_PACK" else 1
    return not any(
        all(host.get(k, 0.0) + 1e-9 >= v * copies for k, v in base.items()) for host in hosts
    )


def _autoscaler_node_types(ray: Any) -> list[dict[str, float]] | None:
    """The resources of each node type Ray's autoscaler may start, as Ray Data reads them; []
    for the Ray instance this daemon started (no autoscaler adds to it); None where Ray does
    not say: a private state API that differs, or a joined cluster that publishes no
    autoscaler config (a static one, or an autoscaler that does not report its node types:
    GPU nodes scaled up from zero would be missed), so nothing is taken for "never" there."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:  # noqa: BLE001 (a private API: any change in it means "not known")
        return None
    if not config:
        return [] if _started_here(ray) else None
    groups = config.node_group_configs
    return [dict(g.resources) for g in groups if g.resources and g.max_count != 0]


def check_entry(address: str, entry: EngineEntry, world_size: int) -> None:
    """Join the cluster at ``address`` and check that a node could hold the engine (ValueErrors
    of one line). Blocking: starting a local Ray instance takes seconds, so a caller on an event
    loop runs this in a thread (``join_for``)."""
    check_feasible(connect(address), entry, world_size)


async def join_for(address: str, entries: Iterable[EngineEntry], default_size: int) -> None:
    """``check_entry`` for each ray engine among ``entries``, in a thread: what every way of
    adding one on the event loop (HTTP, a reload, the autoscaler) awaits first, so the streams
    and probes go on while Ray starts; the handle built after finds Ray joined. Nothing to do
    (and no thread) when none is a ray engine."""
    wanted = [e for e in entries if e.kind == "ray"]
    if wanted:
        await asyncio.to_thread(_check_all, address, wanted, default_size)


def _check_all(address: str, entries: list[EngineEntry], default_size: int) -> None:
    for entry in entries:
        check_entry(address, entry, entry.tensor_parallel_size or default_size)


def _holds(node: dict[str, Any], bundle: dict[str, float], copies: int) -> bool:
    return _copies(node, bundle) >= copies


def _copies(node: dict[str, Any], bundle: dict[str, float]) -> int:
    """How many of ``bundle`` the node could hold at once (a node label holds about 1000)."""
    have = node.get("Resources", {})
    return min(int(have.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())


def _node_summary(node: dict[str, Any]) -> str:
    have = {
        k: v
        for k, v in node.get("Resources", {}).items()
        if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type"))
    }
    return f"{node.get('NodeManagerAddress', '?')} {_format(have)}"


def _format(resources: dict[str, float]) -> str:
    inner = ", ".join(f"{k} = {v:g}" for k, v in sorted(resources.items()))
    return "{" + inner + "}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def autoscale_ray(autoscale: Any) -> bool:
    """Whether the `[autoscale]` section (an AutoscaleConfig, or None) adds Ray engines."""
    return autoscale is not None and autoscale.enabled and autoscale.kind == "ray"


def check_start(
    entries: Iterable[EngineEntry], address: str, autoscales_ray: bool, default_size: int = 1
) -> None:
    """Before the daemon's socket opens: join the cluster and check that a node could hold each
    ``kind = "ray"`` entry (of ``default_size`` ranks unless it says, as its handle will place
    it), so a missing Ray, an address that does not answer or resources no node has stop the
    start with one line. With no Ray engine, a ``router.ray_address`` is
    used only by Ray engines added later (``POST /v1/engines``, a reload): one warning, not a
    refusal, so that a config file shared with daemons that run Ray engines still starts."""
    ray_entries = [e for e in entries if e.kind == "ray"]
    if not ray_entries:
        if address and not autoscales_ray:
            log.warning(
                'router.ray_address (--ray-address) %r is unused: no engine is kind = "ray"; '
                "it applies to Ray engines added later (POST /v1/engines, a reload)",
                address,
            )
        return
    _check_all(address, ray_entries, default_size)
