"""The Kubernetes example (deploy/kubernetes/) hangs together: the Deployment's command line is
one `yaied serve` accepts, its probes hit /health on the port the Service and the InferencePool
send traffic to, and the pool selects the Deployment's pods. Where kubectl reaches a cluster
that has the Inference Extension's CRDs, it accepts the files (client-side dry run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from yaied.cli import build_parser

FOLDER = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


def load(name: str) -> dict:
    return yaml.safe_load((FOLDER / name).read_text())


def test_the_pieces_agree():
    deployment, service, pool = (
        load(f"{n}.yaml") for n in ("deployment", "service", "inferencepool")
    )
    assert (deployment["kind"], service["kind"], pool["kind"]) == (
        "Deployment",
        "Service",
        "InferencePool",
    )
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.command == "serve" and args.host == "0.0.0.0"
    port = container["ports"][0]
    assert port["containerPort"] == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert (
        service["spec"]["selector"] == labels and pool["spec"]["selector"]["matchLabels"] == labels
    )
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert pool["spec"]["targetPorts"] == [{"number": args.port}]


def _cluster_reachable() -> bool:
    if shutil.which("kubectl") is None:
        return False
    probe = subprocess.run(["kubectl", "api-versions"], capture_output=True, text=True, timeout=60)
    return probe.returncode == 0 and "inference.networking.k8s.io/v1" in probe.stdout


@pytest.mark.skipif(
    not _cluster_reachable(),
    reason="no kubectl reaching a cluster with the InferencePool CRD (a client-side dry run "
    "still asks the API server for the kinds it knows)",
)
def test_kubectl_accepts_them():
    done = subprocess.run(
        ["kubectl", "apply", "--dry-run=client", "--validate=false", "-f", str(FOLDER)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
