"""The machine's memory as a start sees it (yaied/core/host_memory.py): /proc and cgroup v2 files
read from fake folders, and the arithmetic of whether CPU engines fit, with injected figures."""

from __future__ import annotations

import pytest

from yaied.core.host_memory import (
    GIB,
    PROCESS_LEAST_BYTES,
    PROCESS_OVERHEAD_BYTES,
    EngineMemory,
    available_bytes,
    check_fits,
)


def test_available_memory_is_known_on_linux():
    """MemAvailable (or a cgroup's room, where less): what a KV pool is checked against."""
    available = available_bytes()
    assert available is not None and 0 <= available < 2**50


def _machine(tmp_path, meminfo_kib: int = 4_000_000):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 8000000 kB\nMemAvailable: {meminfo_kib} kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/x\n0::/app.slice/yaied.service\n")
    service = root / "app.slice" / "yaied.service"
    service.mkdir(parents=True)
    (service / "memory.max").write_text("max\n")
    return proc, root, service


def test_available_memory_is_the_tightest_of_meminfo_and_the_cgroups_above(tmp_path):
    """A service's own MemoryMax, or a slice's above it, caps what a pool may take; the v1
    lines of /proc/self/cgroup name no v2 group."""
    proc, root, service = _machine(tmp_path)
    assert available_bytes(proc, root) == 4_000_000 * 1024  # MemAvailable
    (root / "app.slice" / "memory.max").write_text(f"{3 * GIB}\n")
    (root / "app.slice" / "memory.current").write_text(f"{GIB}\n")
    assert available_bytes(proc, root) == 2 * GIB  # the slice's room
    (service / "memory.max").write_text(f"{GIB}\n")
    (service / "memory.current").write_text(f"{2**29}\n")
    assert available_bytes(proc, root) == 2**29  # the service's, tighter still


def test_a_cgroups_reclaimable_file_cache_is_room_and_its_room_is_never_negative(tmp_path):
    """memory.current counts the page cache of the model files a group read, which the kernel
    drops before it kills anyone: a group full of it read as no room at all, and one charged
    past its memory.max (it happens, briefly) as negative bytes."""
    proc, root, service = _machine(tmp_path)
    (service / "memory.max").write_text(f"{4 * GIB}\n")
    (service / "memory.current").write_text(f"{4 * GIB}\n")
    (service / "memory.stat").write_text(f"anon {GIB}\ninactive_file {3 * GIB}\nactive_file 0\n")
    assert available_bytes(proc, root) == 3 * GIB
    (service / "memory.stat").write_text("anon 0\n")
    (service / "memory.current").write_text(f"{5 * GIB}\n")
    assert available_bytes(proc, root) == 0


def test_engines_that_cannot_fit_even_at_their_least_are_refused_with_the_figures():
    one = EngineMemory(weight_bytes=GIB, kv_bytes=2 * GIB)
    assert one.least == 3 * GIB + PROCESS_LEAST_BYTES
    least = 4 * one.least  # 13 GiB with a quarter GiB a process
    with pytest.raises(ValueError) as raised:
        check_fits([one] * 4, least - 1, "router.engines (--engines) = 4", "--kv-cache-gib")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("router.engines (--engines) = 4: 4 CPU engine(s) need ~13.0 GiB")
    assert "weights ~1.0 GiB + KV pool 2.0 GiB + 256 MiB a process at the least" in message
    assert "more than the 13.0 GiB of memory available here" in message
    assert message.endswith("lower --kv-cache-gib")


def test_engines_past_the_estimate_but_not_their_least_are_only_a_warning():
    """The 1 GiB a process is an estimate: it must not refuse a start that would run."""
    one = EngineMemory(weight_bytes=GIB, kv_bytes=2 * GIB)
    warning = check_fits([one], one.least, "the engine", "--kv-cache-gib")
    assert warning is not None and "need ~4.0 GiB" in warning
    assert "+ 1.0 GiB a process as estimated), more than the 3.2 GiB available here" in warning


def test_engines_that_fit_with_little_headroom_are_a_warning_and_with_room_nothing():
    one = EngineMemory(weight_bytes=GIB, kv_bytes=2 * GIB, ranks=2)
    assert one.total == GIB + 2 * (2 * GIB + PROCESS_OVERHEAD_BYTES)
    warning = check_fits([one], int(one.total / 0.95), "the engine", "--kv-cache-gib")
    assert warning is not None and "leaving under 10%" in warning
    assert "KV pool 2.0 GiB x 2 ranks" in warning
    assert check_fits([one], int(one.total / 0.85), "the engine", "--kv-cache-gib") is None
    assert check_fits([one], None, "the engine", "x") is None  # not known: not checked
    assert check_fits([], 0, "the engine", "x") is None  # no CPU engine: nothing to hold


NO_LIMIT_V1 = 9223372036854771712  # cgroup v1's "no limit": LONG_MAX rounded down to a page


def _machine_v1(tmp_path, line: str = "7:memory:/docker/abc", meminfo_kib: int = 4_000_000):
    """A cgroup v1 (or hybrid) host: the memory controller's own hierarchy under memory/."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 8000000 kB\nMemAvailable: {meminfo_kib} kB\n")
    (proc / "self" / "cgroup").write_text(f"9:cpuset:/docker/abc\n{line}\n0::/docker/abc\n")
    mount = root / "memory"
    mount.mkdir(parents=True)
    (mount / "memory.limit_in_bytes").write_text(f"{NO_LIMIT_V1}\n")  # the root group
    (mount / "memory.usage_in_bytes").write_text(f"{6 * GIB}\n")
    return proc, mount


def _limit_v1(folder, limit: int, usage: int, inactive_file: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    stat = f"cache {inactive_file}\ninactive_file 0\ntotal_inactive_file {inactive_file}\n"
    (folder / "memory.stat").write_text(stat)


def test_a_cgroup_v1_memory_limit_and_its_ancestors_cap_the_available_memory(tmp_path):
    """Older Docker, CentOS 7, Kubernetes on cgroup v1: memory.limit_in_bytes was not read, so
    a container's limit was taken for the whole machine's MemAvailable."""
    proc, mount = _machine_v1(tmp_path)
    assert available_bytes(proc, mount.parent) == 4_000_000 * 1024  # no limit: MemAvailable
    _limit_v1(mount / "docker", 3 * GIB, GIB)
    (mount / "docker" / "abc").mkdir()
    assert available_bytes(proc, mount.parent) == 2 * GIB  # the parent's room
    _limit_v1(mount / "docker" / "abc", 2 * GIB, 2 * GIB, inactive_file=GIB)
    assert available_bytes(proc, mount.parent) == GIB  # its own, less its reclaimable cache
    _limit_v1(mount / "docker" / "abc", NO_LIMIT_V1, 5 * GIB)
    (mount / "docker" / "memory.limit_in_bytes").write_text(f"{2**62}\n")
    assert available_bytes(proc, mount.parent) == 4_000_000 * 1024  # huge values: no limit


def test_a_cgroup_v1_memory_line_shared_with_other_controllers_is_read(tmp_path):
    proc, mount = _machine_v1(tmp_path, "4:cpu,memory,cpuacct:/batch/job")
    _limit_v1(mount / "batch" / "job", GIB, 2**29)
    assert available_bytes(proc, mount.parent) == 2**29


def test_a_container_that_sees_its_v1_group_at_the_mount_root_reads_the_roots_limit(tmp_path):
    """Inside a container /proc/self/cgroup names the host's path (/docker/abc), which is not
    under the container's mount: its own group is the mount's root."""
    proc, mount = _machine_v1(tmp_path)
    _limit_v1(mount, 3 * GIB, 2 * GIB, inactive_file=2**29)
    assert available_bytes(proc, mount.parent) == GIB + 2**29


def test_only_the_weights_copies_always_kept_refuse_the_rest_warn():
    """The weights' estimate (worker/weight_bytes.py) has a least (one copy of each) and an
    expected figure (with the CPU path's copies that fit): a start that fits its least runs."""
    one = EngineMemory(weight_bytes=3 * GIB, kv_bytes=2 * GIB, least_weight_bytes=GIB)
    assert one.least == 3 * GIB + PROCESS_LEAST_BYTES
    assert one.total == 5 * GIB + PROCESS_OVERHEAD_BYTES
    warning = check_fits([one], one.least, "the engine", "--kv-cache-gib")
    assert warning is not None and "weights ~3.0 GiB" in warning
    with pytest.raises(ValueError, match=r"weights ~1\.0 GiB \+ KV pool 2\.0 GiB \+ 256 MiB"):
        check_fits([one], one.least - 1, "the engine", "--kv-cache-gib")


def _comounted_v1(tmp_path, name: str, mountinfo: str | None):
    """A cgroup v1 host whose memory controller shares a mount with cpu (``name``: the mount's
    folder), with or without /proc/self/mountinfo."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 8000000 kB\nMemAvailable: {4_000_000} kB\n")
    (proc / "self" / "cgroup").write_text(f"9:cpuset:/\n4:{name}:/docker/abc\n1:name=systemd:/\n")
    if mountinfo is not None:
        (proc / "self" / "mountinfo").write_text(mountinfo)
    _limit_v1(root / name / "docker" / "abc", GIB, 2**29)
    return proc, root


MOUNTINFO = (
    "22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"
    "25 22 0:23 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755\n"
    "31 25 0:28 / /sys/fs/cgroup/cpuset rw,nosuid shared:13 - cgroup cgroup rw,cpuset\n"
    "32 25 0:29 / /sys/fs/cgroup/{name} rw,nosuid,nodev shared:14 - cgroup cgroup rw,{name}\n"
)


@pytest.mark.parametrize("name", ["cpu,memory", "memory,cpu"])
def test_a_cgroup_v1_memory_controller_co_mounted_with_cpu_is_read(tmp_path, name):
    """A v1 host that mounts memory with cpu (/sys/fs/cgroup/cpu,memory, no memory folder): the
    limit was looked for under memory/ only, so the container's 1 GiB read as the machine's
    MemAvailable (3.8 GiB)."""
    proc, root = _comounted_v1(tmp_path, name, MOUNTINFO.format(name=name))
    assert available_bytes(proc, root) == 2**29
    (proc / "self" / "mountinfo").unlink()  # unreadable: the folder's name says it
    assert available_bytes(proc, root) == 2**29


def test_a_v1_memory_mount_found_in_mountinfo_reads_the_group_under_the_mounts_root(tmp_path):
    """Inside a container without its own cgroup namespace, the mount's root is the container's
    group (/docker/abc): the group is what lies under it, the mount point itself here. A mount
    point outside /sys/fs/cgroup is read where it is."""
    proc, root = _comounted_v1(tmp_path, "cpu,memory", None)
    elsewhere = tmp_path / "cg" / "mem"
    _limit_v1(elsewhere, 2 * GIB, GIB)  # the container's group, mounted at its own root
    _limit_v1(elsewhere / "docker" / "abc", 2**28, 0)  # not its group: the host's path
    line = f"40 25 0:30 /docker/abc {elsewhere} rw - cgroup cgroup rw,memory,cpu\n"
    (proc / "self" / "mountinfo").write_text(line)
    assert available_bytes(proc, root) == GIB


def test_a_memory_link_to_a_co_mounted_v1_controller_is_read(tmp_path):
    proc, root = _comounted_v1(tmp_path, "cpu,memory", None)
    (root / "memory").symlink_to("cpu,memory")
    assert available_bytes(proc, root) == 2**29
