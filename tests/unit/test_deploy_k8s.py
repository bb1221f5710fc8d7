"""deploy/k8s: every manifest against Kubernetes' own schemas, and against `recover` itself.

`kubernetes-validate` checks each object against the OpenAPI schemas of Kubernetes 1.37 in
strict mode (an unknown or misspelt field is an error, as `kubectl apply --validate=strict`
makes it). What no schema knows is checked here: the containers' arguments are parsed by
`recover`'s own parser (every flag exists, the job file loads), and the objects refer to
each other correctly (selectors, ports, volumes, Secrets, names the arguments spell).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest

from recover.cli import jobfile
from recover.cli.jobargs import job_from_args
from recover.cli.main import build_parser, job_parser

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the test extra (scripts/setup.sh)")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.37.0"
SECRETS = {"recover-etcd-tls", "recover-controller-tls", "recover-relay-tls", "recover-tokens"}
"""Made by hand with `recover certs` (deploy/k8s/README.md says how)."""


def objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    found = []
    for resource in kustomization["resources"]:
        found += [doc for doc in yaml.safe_load_all((K8S / resource).read_text()) if doc]
    return found


OBJECTS = objects()
BY_NAME = {(o["kind"], o["metadata"]["name"]): o for o in OBJECTS}
WORKLOADS = [o for o in OBJECTS if o["kind"] == "StatefulSet"]


def pod(name: str) -> dict[str, Any]:
    return BY_NAME[("StatefulSet", name)]["spec"]["template"]


def container_args(name: str, values: dict[str, str]) -> list[str]:
    """A workload's command line, with the $(VAR)s Kubernetes would substitute."""
    container = pod(name)["spec"]["containers"][0]
    assert container["command"] == ["recover"]
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in container["args"]]


@pytest.mark.parametrize("obj", [o for o in OBJECTS if o["kind"] != "PodMonitor"],
                         ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_for_kubernetes_in_strict_mode(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, VERSION, strict=True)


def test_the_objects_refer_to_each_other_correctly() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    config_maps = {g["name"] for g in kustomization["configMapGenerator"]}
    claims = {o["metadata"]["name"] for o in OBJECTS if o["kind"] == "PersistentVolumeClaim"}
    for workload in WORKLOADS:
        spec, template = workload["spec"], workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        service = BY_NAME[("Service", spec["serviceName"])]
        assert service["spec"]["clusterIP"] == "None"  # headless: stable pod names
        assert service["spec"]["selector"].items() <= labels.items()
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        claimed = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
        for container in template["spec"]["containers"]:
            assert {m["name"] for m in container["volumeMounts"]} <= volumes.keys() | claimed
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in SECRETS
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    pods = [w["spec"]["template"]["metadata"]["labels"] for w in WORKLOADS]
    for policy in (o for o in OBJECTS if o["kind"] == "NetworkPolicy"):
        selectors = [policy["spec"]["podSelector"]["matchLabels"]]
        selectors += [f["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
                      for f in rule["from"] if "podSelector" in f
                      and "recover.io/operator" not in f["podSelector"]["matchLabels"]]
        for selector in selectors:  # each selects one of the job's workloads
            assert any(selector.items() <= labels.items() for labels in pods), selector


def test_the_podmonitor_scrapes_the_metrics_ports_of_controllers_and_agents() -> None:
    monitor = BY_NAME[("PodMonitor", "recover")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    names = set(expression["values"])
    assert names == {"recover-controller", "recover-agent"}
    for name in names:
        ports = {p["name"] for p in pod(name)["spec"]["containers"][0]["ports"]}
        assert "metrics" in ports
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} == {"metrics"}
    assert {e.get("scheme", "http") for e in endpoints} == {"https", "http"}
    known = {"port", "interval", "scheme", "relabelings", "tlsConfig"}
    assert all(e.keys() <= known for e in endpoints)


def test_the_containers_command_lines_are_recovers_own() -> None:
    parser = build_parser()
    argv = container_args("recover-controller", {"POD_IP": "10.0.0.7",
                                                 "POD_NAME": "recover-controller-0"})
    argv = [a.replace("/etc/recover/job.toml", str(K8S / "job.toml")) for a in argv]
    jobfile.apply(job_parser(parser, ("controller",)), argv[1:])
    args = parser.parse_args(argv)
    job = job_from_args(args)
    assert (job.job_id, job.replicas, job.global_microbatches) == ("gpt-pretrain", 16, 256)
    assert list(job.workload.command) == ["python", "/workspace/train.py"]
    assert args.advertise == "recover-controller-0.recover-controller:50051"
    etcd = BY_NAME[("StatefulSet", "recover-etcd")]["spec"]
    members = [f"recover-etcd-{i}.recover-etcd:2379" for i in range(etcd["replicas"])]
    assert args.store.startswith("etcds://" + ",".join(members) + "?")
    assert args.tls_cert and args.token_file and not args.tls_ca  # tokens, not client certs

    agent = parser.parse_args(container_args("recover-agent", {"POD_IP": "10.0.1.9"}))
    controllers = BY_NAME[("StatefulSet", "recover-controller")]["spec"]["replicas"]
    named = ",".join(f"recover-controller-{i}.recover-controller:50051"
                     for i in range(controllers))
    # The relays' Service first (any relay), then every controller should the relays be gone.
    relays = BY_NAME[("Service", "recover-relay")]["spec"]["ports"][0]["port"]
    assert agent.controller == f"recover-relay:{relays}," + named
    relay = parser.parse_args(container_args("recover-relay", {"POD_IP": "10.0.2.4",
                                                              "POD_NAME": "recover-relay-0"}))
    assert relay.controller == named and relay.listen == f"10.0.2.4:{relays}"
    # Agents prove themselves with tokens: the relay checks the controllers with the CA but
    # asks its agents for no certificate (they have none), and sends a relay token upstream.
    assert relay.agents_by_token and relay.tls_ca and relay.token_file == "/tokens/relay"
    # No --agent-id: each start is named after its pod plus a random suffix, so a restarted
    # container or a replaced pod never claims an id the controller already knows.
    assert agent.agent_id is None
    from recover.agent.config import AgentConfig

    first, second = (AgentConfig(controller="c:1", slots=1).agent_id for _ in range(2))
    hostname = socket.gethostname()  # in a pod: the pod's name
    assert first != second and first.startswith(f"{hostname}-") and second.startswith(hostname)
    gpus = pod("recover-agent")["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert agent.slots == gpus
    assert agent.tls_ca and agent.token_file and not agent.tls_cert
