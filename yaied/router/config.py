"""The `[router]` section and the `[[engines]]` entries of config/yaied.toml.

yaied/core/config.py owns the engine's sections and skips these, as it does `[server]`.
Precedence is the same: defaults < TOML < ``YAIED_ROUTER_<KEY>`` < explicit overrides
(`--engines`, ...).

Engines: with no `[[engines]]` entry and ``router.engines = 1`` the daemon runs one engine in its
own process, as it always did. ``router.engines = N > 1`` starts N local engine processes (one per
GPU where there are N, else N CPU processes sharing the cores). `[[engines]]` entries list the
engines explicitly: ``kind = "local"`` with a ``device``, ``kind = "remote"`` with the ``url``
of another yaied daemon, or ``kind = "ray"``: ``num_engines`` Ray actors, each holding
``resources`` on a node Ray picks (or the one with the custom resource ``node``), reached from
the router through Ray (router/ray_handle.py; ``router.ray_address`` or ``--ray-address`` names
the cluster). A remote's key is best kept out of the TOML (installed world-readable):
``api_key_env`` names an environment variable (systemd's EnvironmentFile), ``api_key_file`` a file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from yaied.core.config import load_section, read_toml
from yaied.core.forwarding import is_own_address
from yaied.router.policy import POLICIES, RoutingThresholds

ENGINE_KINDS = ("local", "remote", "ray")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray's names
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_CUDA_N = re.compile(r"cuda:[0-9]{1,4}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "autellix"  # autellix | round_robin | least_loaded
    engines: int = 1  # local engines when no [[engines]] is given; 1 = in the daemon's process
    long_call_threshold: int = 2048  # prompt tokens; longer calls follow their session's pin
    imbalance_abs_threshold: int = 64  # pins yield when max - min outstanding requests exceeds this
    imbalance_rel_threshold: float = 1.5  # ... and max exceeds this times min
    health_check_interval_seconds: float = 5.0  # probes of remote engines (and of down ones)
    failure_threshold: int = 3  # consecutive failures that mark a remote engine down
    success_threshold: int = 2  # consecutive successful probes that bring it back
    restart_backoff_seconds: float = 1.0  # first delay before restarting a dead engine; doubles
    max_restart_backoff_seconds: float = 30.0  # the longest delay between restarts
    lifecycle_ttl_seconds: float = 600.0  # how long finished calls stay queryable
    # Connections to each remote daemon. Every open stream holds one; calls beyond wait for one
    # (back-pressure, not a failure). Above server.max_queue_len (1024) plus the running calls.
    remote_max_connections: int = 2048
    # A remote stream silent this long is dead: 3 of the remote's SSE pings (sse_ping_seconds 15).
    remote_read_timeout_seconds: float = 45.0
    # The Ray cluster that kind = "ray" engines run on: "auto" (the one this machine belongs to),
    # HOST:PORT (its GCS), or "" to start a Ray instance on this machine, sized to it.
    ray_address: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"router.policy must be one of {', '.join(POLICIES)}; got {self.policy!r}"
            )
        for name in ("engines", "failure_threshold", "success_threshold", "remote_max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"router.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_call_threshold", "imbalance_abs_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"router.{name} must be >= 0, got {getattr(self, name)}")
        if not self.imbalance_rel_threshold >= 1.0:
            raise ValueError("router.imbalance_rel_threshold must be >= 1")
        for name in (
            "health_check_interval_seconds",
            "restart_backoff_seconds",
            "max_restart_backoff_seconds",
            "lifecycle_ttl_seconds",
            "remote_read_timeout_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"router.{name} must be > 0, got {getattr(self, name)}")

    @property
    def thresholds(self) -> RoutingThresholds:
        return RoutingThresholds(
            self.long_call_threshold, self.imbalance_abs_threshold, self.imbalance_rel_threshold
        )


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One `[[engines]]` table."""

    # local (a process on this machine) | remote (another yaied daemon) | ray (Ray actors)
    kind: str = "local"
    name: str = ""  # stable, for reloads and logs; "" = made from kind and device or url
    device: str = "auto"  # local: auto | cpu | cuda | cuda:N
    threads: int = 0  # local on CPU: torch threads; 0 = the cores divided among local engines
    # local: devices this engine spans (tensor parallelism); 0 = engine.tensor_parallel_size,
    # or the number of device_ids when they are given
    tensor_parallel_size: int = 0
    device_ids: tuple[int, ...] = ()  # local on CUDA: its GPUs, say [2, 3]; () = from device
    url: str = ""  # remote: the daemon's base URL, say http://10.0.0.2:8000
    api_key: str = field(default="", repr=False)  # remote: its Bearer key (better: the two below)
    api_key_env: str = ""  # remote: the environment variable that holds its key
    api_key_file: str = ""  # remote: a file that holds its key (its first line that is not a #)
    # ray: engines of this entry (each an actor); the config's list holds one entry per engine
    num_engines: int = 1
    # ray: what each engine holds on its node, e.g. {CPU = 2} or {GPU = 1}; () = {CPU = 1}.
    # Stored as sorted (name, amount) pairs, so the entry stays hashable.
    resources: tuple[tuple[str, float], ...] = ()
    node: str = ""  # ray: a custom resource naming the node(s) the engine must run on
    placement_strategy: str = "STRICT_PACK"  # ray: how a tensor-parallel engine's bundles sit
    max_restarts: int = 3  # ray: restarts Ray makes of a dead engine actor (-1: no limit)
    key: str = field(init=False, repr=False, compare=False)  # the key, from whichever is set

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self._read_key())
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engines.kind must be local, remote or ray, got {self.kind!r}")
        self._check_ray()
        if self.kind == "remote":
            _check_url(self.url)
        if self.name and not _NAME.fullmatch(self.name):
            raise ValueError(f"engines.name is 1 to 64 of [A-Za-z0-9._:-], got {self.name!r}")
        if self.threads < 0:
            raise ValueError(f"engines.threads must be >= 0, got {self.threads}")
        if self.device not in ("auto", "cpu", "cuda") and not _CUDA_N.fullmatch(self.device):
            raise ValueError(f"engines.device must be auto, cpu, cuda or cuda:N: {self.device!r}")
        if any(i < 0 for i in self.device_ids):
            raise ValueError(f"engines.device_ids must be >= 0, got {list(self.device_ids)}")
        if self.tensor_parallel_size < 0:
            raise ValueError(
                f"engines.tensor_parallel_size must be >= 0: {self.tensor_parallel_size}"
            )
        size, ids = self.tensor_parallel_size, self.device_ids
        if ids and (
            size not in (0, len(ids))
            or self.device not in ("auto", "cuda")
            or len(set(ids)) < len(ids)
        ):
            raise ValueError(
                f"engines.device_ids {list(ids)} must name tensor_parallel_size ({size}) distinct "
                'GPUs, with device = "cuda" (or "auto")'
            )

    def _check_ray(self) -> None:
        if self.kind != "ray":
            ray_only = ("num_engines", "resources", "node")
            if given := [
                n
                for n in ray_only
                if getattr(self, n) != EngineEntry.__dataclass_fields__[n].default
            ]:
                raise ValueError(f'engines.{given[0]} is for kind = "ray" engines')
            return
        if importlib.util.find_spec("ray") is None:
            raise ValueError('kind = "ray" engines need Ray: pip install "yaied[ray]"')
        if self.num_engines < 1:
            raise ValueError(f"engines.num_engines must be >= 1, got {self.num_engines}")
        if self.max_restarts < -1:
            raise ValueError(f"engines.max_restarts must be >= -1, got {self.max_restarts}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"engines.placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}"
            )
        for name, amount in self.resources:
            if not amount > 0:
                raise ValueError(f"engines.resources.{name} must be > 0, got {amount}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError('a ray engine\'s device is "auto", "cpu" or "cuda": Ray picks the GPU')

    def _read_key(self) -> str:
        """The remote's key, read once at load: a missing variable or file stops the start."""
        given = [n for n in ("api_key", "api_key_env", "api_key_file") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"a remote engine takes one of {', '.join(given)}, not several")
        if self.api_key_env:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise ValueError(f"engines.api_key_env: ${self.api_key_env} is not set")
            return key
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or exc
                raise ValueError(f"engines.api_key_file {self.api_key_file!r}: {reason}") from None
            keys = [k for k in (line.strip() for line in lines) if k and not k.startswith("#")]
            if not keys:
                raise ValueError(f"engines.api_key_file {self.api_key_file!r} holds no key")
            return keys[0]
        return self.api_key


def load_router_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[RouterConfig, tuple[EngineEntry, ...]]:
    """`[router]` (then ``YAIED_ROUTER_*``, then ``overrides``) and the `[[engines]]` list."""
    data = read_toml(path)
    router = load_section(RouterConfig, "router", data, env, overrides)
    entries = data.get("engines", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("engines must be an array of tables: [[engines]]")
    engines = expand_engines(parse_engine_entry(e) for e in entries)
    _check_unique_names(engines)  # before the daemon listens, and before a reload applies them
    return router, engines


def expand_engines(entries: Iterable[EngineEntry]) -> tuple[EngineEntry, ...]:
    """One entry per engine: a ray entry of ``num_engines`` N becomes N entries of one engine,
    named ``<name>-1`` .. ``<name>-N`` where the entry has a name (unnamed ones are numbered by
    the pool as alike entries are), so a reload diffs them by name as any other."""
    out: list[EngineEntry] = []
    for entry in entries:
        if entry.num_engines == 1:
            out.append(entry)
            continue
        for i in range(entry.num_engines):
            name = f"{entry.name}-{i + 1}" if entry.name else ""
            out.append(dataclasses.replace(entry, num_engines=1, name=name))
    return tuple(out)


def _check_url(url: str) -> None:
    """A remote engine's URL: http(s) with a host and a valid port, else a ValueError (urllib's
    own errors, say "Invalid IPv6 URL", came at start-up after the daemon listened)."""
    problem = "" if url.startswith(("http://", "https://")) else "not http(s)"
    if not problem:
        try:
            parts = urlsplit(url)
            problem = "" if parts.hostname else "no host"
            parts.port  # noqa: B018 - raises on a port that is not a number in 0..65535
        except ValueError as exc:
            problem = str(exc)
    if problem:
        raise ValueError(f"a remote engine needs url = http(s)://host:port, got {url!r}: {problem}")


def refuse_own_address(entries: Iterable[EngineEntry], host: str, port: int) -> None:
    """A ValueError for a remote engine whose URL is this daemon's own address (``host``:``port``,
    what it listens on): its calls would come back here in a loop. The config's check; the
    instance id (router/remote.py) catches the other names this daemon goes by."""
    for entry in entries:
        if entry.kind == "remote" and is_own_address(entry.url, host, port):
            raise ValueError(
                f"remote engine {entry.url} is this daemon's own address ({host}:{port}): its "
                "calls would come back here in a loop; give another yaied daemon's URL"
            )


def _check_unique_names(entries: tuple[EngineEntry, ...]) -> None:
    given = [e.name for e in entries if e.name]
    if len(set(given)) != len(given):
        twice = sorted({name for name in given if given.count(name) > 1})
        raise ValueError(f"two [[engines]] entries share a name: {', '.join(twice)}")


def parse_engine_entry(table: dict[str, Any]) -> EngineEntry:
    known = {f.name: type(f.default) for f in dataclasses.fields(EngineEntry) if f.init}
    table = dict(table)
    for key, value in table.items():
        if key == "resources":  # resources = {CPU = 2}
            if not isinstance(value, dict):
                raise ValueError(f"engines.resources must be a table like {{CPU = 2}}: {value!r}")
            table[key] = value = _resources(value)
            continue
        if key not in known:
            raise ValueError(f"unknown setting engines.{key}; known: {', '.join(known)}")
        if known[key] is tuple:  # device_ids = [2, 3]
            if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise ValueError(f"engines.{key} must be a list of integers, got {value!r}")
            table[key] = value = tuple(value)
        if not isinstance(value, known[key]) or isinstance(value, bool):
            raise ValueError(f"engines.{key} must be a {known[key].__name__}, got {value!r}")
    return EngineEntry(**table)


def _resources(table: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    for name, amount in table.items():
        if not isinstance(amount, int | float) or isinstance(amount, bool):
            raise ValueError(f"engines.resources.{name} must be a number, got {amount!r}")
    return tuple(sorted((str(k), float(v)) for k, v in table.items()))
