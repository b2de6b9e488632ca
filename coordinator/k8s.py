"""Kubernetes manifests for a zeroplane job, rendered from its job spec.

    spec = load_job_spec("job.yaml")        # coordinator/jobspec.py
    objects = render(spec, token=token)     # the full manifest set, as dicts
    files = kustomize_tree(spec)            # base + cpu/gpu overlays, as files

[Note: one source for the manifests]
Python builds every object here, once. ``base_objects`` is what does not
depend on the device (the coordinator, the worker StatefulSet without its
image and resources, Services, the PodDisruptionBudget, NetworkPolicy,
PodMonitor, the dashboard ConfigMap); ``device_patch`` is a strategic-merge
patch of the worker StatefulSet for one device kind (image, resources, GPU
tolerations). ``render`` applies the patch in Python; ``kustomize_tree``
writes the same base and the same patch as a kustomize base with ``cpu`` and
``gpu`` overlays. ``k8s/`` in the repository is ``kustomize_tree`` of
``examples/job.yaml``, written by ``zeroplane submit --out k8s --no-apply``;
tests check that it has not drifted, and that ``kubectl kustomize`` of each
overlay equals ``render`` of that device kind.

[Note: how the pieces find each other]
Workers reach the coordinator through its Service, ``<job>-coordinator:50051``
(``$ZEROPLANE_COORDINATOR``), with the bearer token from the ``<job>-token``
Secret (``$ZEROPLANE_TOKEN``; the coordinator reads the same variable).
Each worker pod advertises ``<pod>.<job>-workers`` (``$ZEROPLANE_HOST``), its
stable name under the headless Service, which is where the other ranks find
the rendezvous store when it is rank 0. ``publishNotReadyAddresses`` lets
those names resolve before a pod is ready, since the first generation forms
while pods are still starting. The coordinator keeps its state file on a
small PersistentVolumeClaim, so a restarted coordinator re-attaches to the
workers that kept training.

[Note: elastic scaling]
``kubectl scale statefulset/<job>-worker --replicas=N`` is the scaling
interface. The coordinator is started with the job's ``--min-workers`` and
``--max-workers`` (pods times ``device.count``): new pods register and join
the next generation after the join window; pods removed by a scale-down get
SIGTERM and ``terminationGracePeriodSeconds`` to hand their shards over;
pods beyond ``max`` wait as standbys, and below ``min`` the job waits.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from coordinator.config import ADDRESS_ENV, METRICS_PORT_ENV, TOKEN_ENV
from coordinator.jobspec import COMPRESSION_ENV, HOST_ENV, WORKER_ID_ENV, JobSpec

__all__ = [
    "COORDINATOR_PORT",
    "DASHBOARD_CONFIGMAP",
    "KUBERNETES_VERSIONS",
    "OVERLAYS",
    "base_objects",
    "coordinator_args",
    "device_patch",
    "dump_yaml",
    "find_dashboard",
    "kustomize_tree",
    "overlay_for",
    "render",
    "strategic_merge",
    "token_secret",
    "worker_args",
]

logger = logging.getLogger(__name__)

# The Kubernetes versions the manifests are validated against (tests/test_k8s.py).
KUBERNETES_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33")

COORDINATOR_PORT = 50051
# /metrics of every pod (the coordinator's HTTP port also serves its status page).
METRICS_PORT = 9400
STATE_DIR = "/var/lib/zeroplane"
CHECKPOINT_DIR = "/checkpoints"
TMP_DIR = "/tmp"
# What the coordinator's health service reports on (coordinator/server.py's SERVICE_NAME;
# not imported from there, which would pull in grpc's server side to render YAML).
SERVICE_NAME = "zeroplane.coordinator.v1.Coordinator"
# Numeric, so that runAsNonRoot can be checked; the image creates this user.
RUN_AS = 10001
DASHBOARD_CONFIGMAP = "zeroplane-grafana-dashboard"
DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
GPU_RESOURCE = "nvidia.com/gpu"

# ---- objects ----------------------------------------------------------------------------


def _labels(spec: JobSpec, component: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "zeroplane",
        "app.kubernetes.io/instance": spec.name,
    }
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return labels


def _meta(spec: JobSpec, name: str, component: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if spec.namespace is not None:
        meta["namespace"] = spec.namespace
    meta["labels"] = {**_labels(spec, component), "app.kubernetes.io/managed-by": "zeroplane"}
    return meta


_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod_template(
    selector: dict[str, str],
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    *,
    grace_period_s: int,
) -> dict[str, Any]:
    """A hardened pod of one container: no service-account token, no service
    links, the restricted security context."""
    return {
        "metadata": {"labels": selector},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": _pod_security(),
            "terminationGracePeriodSeconds": grace_period_s,
            "containers": [container],
            "volumes": volumes,
        },
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        # So the non-root user can write the state volume.
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _token_env(spec: JobSpec) -> dict[str, Any]:
    return {
        "name": TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": spec.token_secret, "key": "token"}},
    }


def coordinator_args(spec: JobSpec) -> list[str]:
    """``zeroplane coordinator`` arguments for this job (the image's entrypoint is zeroplane)."""
    return [
        "coordinator",
        "--port",
        str(COORDINATOR_PORT),
        "--state-file",
        f"{STATE_DIR}/state.json",
        "--min-workers",
        str(spec.min_processes),
        "--max-workers",
        str(spec.max_processes),
        "--stage",
        spec.stage,
        "--http-port",
        str(METRICS_PORT),
        # The job label of its metrics, as the PodMonitor gives the workers'.
        "--job-name",
        spec.name,
    ]


def worker_args(spec: JobSpec) -> list[str]:
    """``zeroplane run`` arguments that start one pod's worker processes."""
    return [
        "run",
        "--coordinator",
        f"$({ADDRESS_ENV})",
        "--nproc",
        str(spec.device.count),
        # SIGKILL from the launcher comes before the kubelet's.
        "--grace",
        str(max(spec.grace_period_s - 10, 5)),
        # A StatefulSet restarts a container that exits, even with 0.
        "--hold",
        spec.script,
        *spec.args,
    ]


def _coordinator_objects(spec: JobSpec) -> list[dict[str, Any]]:
    selector = _labels(spec, "coordinator")
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.state_storage}},
    }
    if spec.storage_class is not None:
        claim["storageClassName"] = spec.storage_class
    # Kubernetes' own gRPC probe calls grpc.health.v1.Health/Check: readiness asks
    # for the Coordinator service, liveness for the server as a whole ("").
    readiness = {"port": COORDINATOR_PORT, "service": SERVICE_NAME}
    container = {
        "name": "coordinator",
        "image": spec.coordinator_image,
        "args": coordinator_args(spec),
        "env": [_token_env(spec), {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [
            {"name": "grpc", "containerPort": COORDINATOR_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"grpc": readiness, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            "grpc": {"port": COORDINATOR_PORT},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [
            {"name": "state", "mountPath": STATE_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
        ],
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(spec, spec.state_claim, "coordinator"),
            "spec": claim,
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(spec, spec.coordinator, "coordinator"),
            "spec": {
                "selector": selector,
                "ports": [
                    {
                        "name": "grpc",
                        "port": COORDINATOR_PORT,
                        "targetPort": "grpc",
                        "protocol": "TCP",
                        "appProtocol": "grpc",
                    },
                    {
                        "name": "metrics",
                        "port": METRICS_PORT,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                        "appProtocol": "http",
                    },
                ],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(spec, spec.coordinator, "coordinator"),
            "spec": {
                "replicas": 1,
                # One writer of the state volume (ReadWriteOnce): the old pod goes first.
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": selector},
                "template": _pod_template(
                    selector,
                    container,
                    [
                        {
                            "name": "state",
                            "persistentVolumeClaim": {"claimName": spec.state_claim},
                        },
                        {"name": "tmp", "emptyDir": {}},
                    ],
                    grace_period_s=30,
                ),
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(spec, spec.coordinator, "coordinator"),
            "spec": {
                "podSelector": {"matchLabels": selector},
                "policyTypes": ["Ingress"],
                "ingress": [
                    # The control plane: this job's workers only. (kubectl port-forward
                    # and the kubelet's probes do not pass through NetworkPolicy.)
                    {
                        "from": [{"podSelector": {"matchLabels": _labels(spec, "worker")}}],
                        "ports": [{"protocol": "TCP", "port": "grpc"}],
                    },
                    # Metrics and the status page: Prometheus may run in any namespace.
                    {"ports": [{"protocol": "TCP", "port": "metrics"}]},
                ],
            },
        },
    ]


def _worker_objects(spec: JobSpec) -> list[dict[str, Any]]:
    selector = _labels(spec, "worker")
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": ADDRESS_ENV, "value": f"{spec.coordinator}:{COORDINATOR_PORT}"},
        _token_env(spec),
        # The pod's stable name under the headless Service (see [Note: how the pieces ...]).
        {"name": HOST_ENV, "value": f"$(POD_NAME).{spec.workers_service}"},
    ]
    if spec.device.count == 1:
        # Several processes per pod fall back to <hostname>-<local rank>, which is the
        # pod name too; one process is named after the pod alone.
        env.append({"name": WORKER_ID_ENV, "value": "$(POD_NAME)"})
    # One process serves /metrics on the pod's named port; several take free ports
    # and register them with the coordinator, whose /sd lists them for Prometheus.
    metrics_port = METRICS_PORT if spec.device.count == 1 else 0
    env.append({"name": METRICS_PORT_ENV, "value": str(metrics_port)})
    env.append({"name": COMPRESSION_ENV, "value": spec.compression})
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    env += [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    mounts = [
        {"name": "tmp", "mountPath": TMP_DIR},
        # NCCL and DataLoader workers need more shared memory than a container's 64 MiB.
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    objects: list[dict[str, Any]] = []
    if spec.checkpoint_storage is not None:
        # One directory every rank writes its shards to and any rank can read back.
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": spec.checkpoint_storage}},
        }
        if spec.checkpoint_storage_class is not None:
            claim["storageClassName"] = spec.checkpoint_storage_class
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": _meta(spec, spec.checkpoint_claim, "worker"),
                "spec": claim,
            }
        )
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint_claim}}
        )
    container = {
        "name": "worker",
        "image": spec.image,
        "args": worker_args(spec),
        "env": env,
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    return [
        *objects,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(spec, spec.workers_service, "worker"),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": selector,
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(spec, spec.worker, "worker"),
            "spec": {
                "serviceName": spec.workers_service,
                "replicas": spec.workers.replicas,
                # Workers start together; the coordinator, not pod order, assigns ranks.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "template": _pod_template(
                    selector, container, volumes, grace_period_s=spec.grace_period_s
                ),
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(spec, spec.worker, "worker"),
            "spec": {
                # Voluntary evictions (node drains) may take the job down to its minimum.
                "minAvailable": spec.workers.min,
                "selector": {"matchLabels": selector},
            },
        },
    ]


def _monitoring_objects(spec: JobSpec, dashboard: str | None) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": _meta(spec, spec.name),
            "spec": {
                # Prometheus' job label becomes the zeroplane job's name.
                "jobLabel": "app.kubernetes.io/instance",
                "selector": {"matchLabels": _labels(spec)},
                "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
            },
        }
    ]
    if dashboard is not None:
        meta = _meta(spec, DASHBOARD_CONFIGMAP)
        # Shared by every job in the namespace: no instance label.
        del meta["labels"]["app.kubernetes.io/instance"]
        meta["labels"]["grafana_dashboard"] = "1"
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta,
                "data": {"zeroplane.json": dashboard},
            }
        )
    return objects


def token_secret(spec: JobSpec, token: str) -> dict[str, Any]:
    """The Secret holding the bearer token, as kustomize's secretGenerator makes it."""
    if not token.strip():
        raise ValueError("token must be non-empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, spec.token_secret),
        "type": "Opaque",
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def find_dashboard(directory: Path = DASHBOARD_DIR) -> str | None:
    """The Grafana dashboard JSON shipped in deploy/grafana, if this checkout has one."""
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not files:
        return None
    if len(files) > 1:
        logger.warning("several dashboards in %s; using %s", directory, files[0].name)
    text = files[0].read_text()
    json.loads(text)  # a broken dashboard fails here, not in Grafana's sidecar
    return text


def base_objects(spec: JobSpec, *, dashboard: str | None = None) -> list[dict[str, Any]]:
    """Every object but the token Secret, without the device-specific worker fields."""
    return [
        *_coordinator_objects(spec),
        *_worker_objects(spec),
        *_monitoring_objects(spec, dashboard),
    ]


def device_patch(spec: JobSpec) -> dict[str, Any]:
    """The strategic-merge patch of the worker StatefulSet for ``spec.device``."""
    requests: dict[str, Any] = dict(spec.resources)
    limits: dict[str, Any] = {}
    if "memory" in spec.resources:
        limits["memory"] = spec.resources["memory"]
    pod: dict[str, Any] = {}
    if spec.device.kind == "cuda":
        requests[GPU_RESOURCE] = spec.device.count
        limits[GPU_RESOURCE] = spec.device.count
        # GPU nodes are commonly tainted so that only GPU workloads land there.
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    container = {
        "name": "worker",
        "image": spec.image,
        "resources": {"requests": requests, "limits": limits},
    }
    patch_meta = {"name": spec.worker}
    if spec.namespace is not None:
        patch_meta["namespace"] = spec.namespace
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": patch_meta,
        "spec": {"template": {"spec": {"containers": [container], **pod}}},
    }


def strategic_merge(target: Any, patch: Any) -> Any:
    """``patch`` merged into ``target`` as kustomize does for the patches made here:
    maps merge by key, lists of named maps (containers, env, volumes) merge by name,
    other lists are replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            merged = strategic_merge(target[key], value) if key in target else value
            out[key] = copy.deepcopy(merged)
        return out
    if (
        isinstance(target, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in [*target, *patch])
    ):
        out_list = list(target)
        index = {x["name"]: i for i, x in enumerate(out_list)}
        for item in patch:
            if item["name"] in index:
                i = index[item["name"]]
                out_list[i] = strategic_merge(out_list[i], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def render(
    spec: JobSpec, *, token: str | None = None, dashboard: str | None = None
) -> list[dict[str, Any]]:
    """The job's manifests for its device kind; the token Secret first when ``token`` is given."""
    patch = device_patch(spec)
    objects = []
    for obj in base_objects(spec, dashboard=dashboard):
        if obj["kind"] == patch["kind"] and obj["metadata"]["name"] == patch["metadata"]["name"]:
            obj = strategic_merge(obj, {k: v for k, v in patch.items() if k != "metadata"})
        objects.append(obj)
    if token is not None:
        objects.insert(0, token_secret(spec, token))
    return objects


# ---- files --------------------------------------------------------------------------------

GENERATED = (
    "# Generated by `zeroplane submit` from a job spec (see coordinator/k8s.py); "
    "edit the spec, not this file.\n"
)
OVERLAYS = {"cpu": "cpu", "gpu": "cuda"}


class _Dumper(yaml.SafeDumper):
    # Objects share dicts (a selector is also the template's labels); write them out
    # in full rather than as YAML anchors, which kubectl reads but people trip over.
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    # Multi-line text (the dashboard JSON) as a literal block, readable in a diff.
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """Objects as a multi-document YAML stream (block style, keys in the order built)."""
    return "---\n".join(
        yaml.dump(dict(o), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
        for o in objects
    )


def _file_name(obj: Mapping[str, Any]) -> str:
    kind = re.sub(r"(?<!^)(?=[A-Z])", "-", obj["kind"]).lower()
    return f"{obj['metadata']['name']}.{kind}.yaml"


def kustomize_tree(spec: JobSpec, *, dashboard: str | None = None) -> dict[str, str]:
    """``base/`` and ``overlays/{cpu,gpu}/`` as {relative path: file text}.

    The token Secret comes from a ``secretGenerator`` reading ``base/token``,
    which is not part of the tree (``base/.gitignore`` keeps it out of git).
    """
    files: dict[str, str] = {}
    resources = []
    for obj in base_objects(spec, dashboard=dashboard):
        name = _file_name(obj)
        files[f"base/{name}"] = GENERATED + dump_yaml([obj])
        resources.append(name)
    secret_meta = token_secret(spec, "x")["metadata"]
    base: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
        "secretGenerator": [
            {
                "name": spec.token_secret,
                **({"namespace": spec.namespace} if spec.namespace else {}),
                "files": ["token"],
                "type": "Opaque",
                "options": {"labels": secret_meta["labels"]},
            }
        ],
        # A fixed Secret name: the workers' env refers to it, and a new token must
        # not roll the coordinator behind their back.
        "generatorOptions": {"disableNameSuffixHash": True},
    }
    files["base/kustomization.yaml"] = GENERATED + dump_yaml([base])
    files["base/.gitignore"] = "# the bearer token: `openssl rand -hex 32 > token`\ntoken\n"
    for overlay, kind in OVERLAYS.items():
        patch = device_patch(spec.for_device(kind))
        files[f"overlays/{overlay}/worker-{overlay}.patch.yaml"] = GENERATED + dump_yaml([patch])
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": ["../../base"],
            "patches": [{"path": f"worker-{overlay}.patch.yaml"}],
        }
        files[f"overlays/{overlay}/kustomization.yaml"] = GENERATED + dump_yaml([kustomization])
    return files


def overlay_for(spec: JobSpec) -> str:
    """The overlay directory name for the spec's device kind."""
    return next(o for o, k in OVERLAYS.items() if k == spec.device.kind)
