"""Whether a Ray engine that no node holds is a setting to fix (exit 2: no node, known or that
Ray's autoscaler may add, has its resources in total) or may be met later (exit 1, which systemd
retries: nodes not up, a labelled node away, a cluster short of nodes): router/ray_cluster.py
over fake node listings and autoscaler configs, as ray.nodes() and Ray's cluster config give
them. tests/router/test_ray_engines.py checks the same on a real cluster (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.test_cli import assert_one_line_error, assert_one_line_failure, run_main
from yaied.core.errors import UnreachableError
from yaied.router import ray_cluster
from yaied.router.config import EngineEntry


def node(address: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeManagerAddress": address, "Alive": alive, "Resources": resources}


UNKNOWN = object()  # a Ray whose autoscaler state cannot be read


def fake_ray(nodes: list[dict], node_types=None):
    """``node_types``: None for no autoscaler, else the resources of each node type it may add;
    UNKNOWN: reading them fails."""

    def get_cluster_config():
        if node_types is UNKNOWN:
            raise AttributeError("no such thing in this Ray")
        if node_types is None:
            return None
        groups = [SimpleNamespace(resources=t, max_count=-1, min_count=0) for t in node_types]
        return SimpleNamespace(node_group_configs=groups)

    state = SimpleNamespace(get_cluster_config=get_cluster_config)
    return SimpleNamespace(
        nodes=lambda: nodes, _private=SimpleNamespace(state=SimpleNamespace(state=state))
    )


CPU_NODES = [
    node("10.0.0.1", CPU=0),
    node("10.0.0.2", CPU=2, **{"box-b": 1}),
    node("10.0.0.3", CPU=4),
]


def verdict(nodes, entry: EngineEntry, world_size: int = 1, node_types=None) -> str:
    """ "fits", "later" (UnreachableError: exit 1) or "never" (a plain ValueError: exit 2)."""
    try:
        ray_cluster.check_feasible(fake_ray(nodes, node_types), entry, world_size)
    except UnreachableError as exc:
        assert "\n" not in str(exc)
        return "later"
    except ValueError as exc:
        assert "\n" not in str(exc)
        return "never"
    return "fits"


@pytest.fixture(autouse=True)
def started_here(monkeypatch):
    """The Ray instance is the daemon's own unless a test says otherwise (no autoscaler config
    published then means none: nothing adds nodes to it)."""
    monkeypatch.setattr(ray_cluster, "_started_here", lambda ray: True)


def ray_entry(**fields) -> EngineEntry:
    resources = tuple(sorted(fields.pop("resources", {}).items()))
    return EngineEntry(kind="ray", resources=resources, **fields)


@pytest.mark.parametrize(
    ("entry", "world_size", "expected"),
    [
        (ray_entry(resources={"CPU": 4}), 1, "fits"),  # busy or not: a node has 4 in total
        (ray_entry(resources={"GPU": 1}), 1, "never"),  # no node has a GPU
        (ray_entry(resources={"CPU": 64}), 1, "never"),  # more than any node has
        (ray_entry(resources={"CPU": 2}), 2, "fits"),  # STRICT_PACK: node 3 holds both
        (ray_entry(resources={"CPU": 3}), 2, "never"),  # STRICT_PACK: 6 on no node
        # each rank fits a node, but there are not enough such nodes yet
        (ray_entry(resources={"CPU": 3}, placement_strategy="PACK"), 2, "later"),
        (ray_entry(resources={"CPU": 2}, placement_strategy="STRICT_SPREAD"), 3, "later"),
        (ray_entry(resources={"CPU": 8}, placement_strategy="SPREAD"), 2, "never"),
        (ray_entry(node="box-b"), 1, "fits"),
        (ray_entry(node="box-b", resources={"CPU": 4}), 1, "never"),  # box-b has 2
        (ray_entry(node="box-c"), 1, "later"),  # no such node up: it may join after a reboot
    ],
)
def test_a_bundle_past_every_nodes_total_is_a_setting_and_one_short_of_nodes_may_wait(
    entry, world_size, expected
):
    """It was exit 1 always: a request no node of the cluster could ever hold (a GPU on a
    cluster without one, more CPUs than any node has) was retried by systemd forever."""
    assert verdict(CPU_NODES, entry, world_size) == expected


def test_nodes_that_may_come_keep_it_a_wait():
    """A node that left (Alive false) may return, Ray's autoscaler may add a node of a type
    that holds it, and a cluster whose nodes are not up yet may have them soon: exit 1. Where
    Ray's autoscaler state cannot be read, nothing is taken for "never"."""
    gpu = ray_entry(resources={"GPU": 1})
    assert verdict([*CPU_NODES, node("10.0.0.9", alive=False, GPU=1)], gpu) == "later"
    assert verdict(CPU_NODES, gpu, node_types=[{"CPU": 8, "GPU": 1}]) == "later"
    assert verdict(CPU_NODES, gpu, node_types=[{"CPU": 8}]) == "never"
    assert verdict(CPU_NODES, gpu, node_types=UNKNOWN) == "later"
    assert verdict([node("10.0.0.1", alive=False, CPU=4)], ray_entry()) == "later"
    assert verdict([], ray_entry()) == "later"
    away = [node("10.0.0.2", alive=False, CPU=2, **{"box-b": 1}), node("10.0.0.3", CPU=4)]
    assert verdict(away, ray_entry(node="box-b", resources={"CPU": 4})) == "later"


def test_a_joined_cluster_that_publishes_no_autoscaler_config_may_yet_hold_it(monkeypatch):
    """A joined cluster without a published autoscaler config may still have an autoscaler
    (one that does not report its node types: GPU nodes scaled up from zero): taking that for
    "none" made a start that would have run exit 2 for good, where exit 1 costs a few
    retries (the review)."""
    monkeypatch.setattr(ray_cluster, "_started_here", lambda ray: False)
    assert verdict(CPU_NODES, ray_entry(resources={"GPU": 1})) == "later"
    assert verdict(CPU_NODES, ray_entry(resources={"GPU": 1}), node_types=[{"CPU": 8}]) == "never"


def test_the_setting_line_names_the_figures_and_what_to_lower():
    with pytest.raises(ValueError) as raised:
        ray_cluster.check_feasible(fake_ray(CPU_NODES), ray_entry(resources={"CPU": 3}), 2)
    assert not isinstance(raised.value, UnreachableError)
    assert str(raised.value) == (
        "no Ray node can hold an engine of {CPU = 6} (2 ranks, STRICT_PACK) (nodes: 10.0.0.1 "
        "{CPU = 0}; 10.0.0.2 {CPU = 2, box-b = 1}; 10.0.0.3 {CPU = 4}): more than any node has "
        "in total, or a node type of Ray's autoscaler would; lower engines.resources or "
        "engines.tensor_parallel_size"
    )


@pytest.mark.parametrize(("setting", "code"), [("resources = {GPU = 1}", 2), ('node = "box-c"', 1)])
def test_the_start_exits_2_for_a_setting_and_1_for_a_wait(
    capsys, tiny_model_dirs, tmp_path, monkeypatch, setting, code
):
    monkeypatch.setattr(ray_cluster, "connect", lambda address: fake_ray(CPU_NODES))
    config = tmp_path / "yaied.toml"
    config.write_text(f'[[engines]]\nkind = "ray"\n{setting}\n')
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--config", str(config)]
    check = assert_one_line_error if code == 2 else assert_one_line_failure
    check(*run_main(capsys, *argv), r"no Ray node can hold an engine of \{")
