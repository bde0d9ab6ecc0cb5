"""The `[router]` section and the `[[engines]]` entries of config/yaied.toml.

yaied/core/config.py owns the engine's sections and skips these, as it does `[server]`.
Precedence is the same: defaults < TOML < ``YAIED_ROUTER_<KEY>`` < explicit overrides
(`--engines`, ...).

Engines: with no `[[engines]]` entry and ``router.engines = 1`` the daemon runs one engine in its
own process, as it always did. ``router.engines = N > 1`` starts N local engine processes (one per
GPU where there are N, else N CPU processes sharing the cores). `[[engines]]` entries list the
engines explicitly: ``kind = "local"`` with a ``device``, or ``kind = "remote"`` with the ``url``
of another yaied daemon. A remote's key is best kept out of the TOML (installed world-readable):
``api_key_env`` names an environment variable (systemd's EnvironmentFile), ``api_key_file`` a file.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yaied.core.config import load_section, read_toml
from yaied.router.policy import POLICIES, RoutingThresholds

ENGINE_KINDS = ("local", "remote")
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")


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

    kind: str = "local"  # local (a process on this machine) | remote (another yaied daemon)
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
    key: str = field(init=False, repr=False, compare=False)  # the key, from whichever is set

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self._read_key())
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engines.kind must be local or remote, got {self.kind!r}")
        if self.kind == "remote" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"a remote engine needs url = http(s)://host:port, got {self.url!r}")
        if self.name and not _NAME.fullmatch(self.name):
            raise ValueError(f"engines.name is 1 to 64 of [A-Za-z0-9._:-], got {self.name!r}")
        if self.threads < 0:
            raise ValueError(f"engines.threads must be >= 0, got {self.threads}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"engines.device must be auto, cpu, cuda or cuda:N: {self.device!r}")
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
    return router, tuple(parse_engine_entry(e) for e in entries)


def parse_engine_entry(table: dict[str, Any]) -> EngineEntry:
    known = {f.name: type(f.default) for f in dataclasses.fields(EngineEntry) if f.init}
    table = dict(table)
    for key, value in table.items():
        if key not in known:
            raise ValueError(f"unknown setting engines.{key}; known: {', '.join(known)}")
        if known[key] is tuple and isinstance(value, list):  # device_ids = [2, 3]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ValueError(f"engines.{key} must be a list of integers, got {value!r}")
            table[key] = value = tuple(value)
        if not isinstance(value, known[key]) or isinstance(value, bool):
            raise ValueError(f"engines.{key} must be a {known[key].__name__}, got {value!r}")
    return EngineEntry(**table)
