"""Kubernetes manifests for a zeroplane job, rendered from its job spec.

    spec = load_job_spec("job.yaml")        # coordinator/launchers/jobspec.py
    objects = render(spec, token=token)     # the full manifest set, as dicts
    files = kustomize_tree(spec)            # base + cpu/gpu overlays, as files

[Note: one source for the manifests]
Python builds every object here, once. ``base_objects`` is what does not
depend on the device (the coordinator, the workers' Services, the
PodDisruptionBudget, NetworkPolicy, the dashboard ConfigMap and, when asked
for, the PodMonitor); ``worker_objects`` is the workers' workload for one
device kind (image, resources, GPU tolerations) in the spec's ``format``.
``render`` is the two together; ``kustomize_tree`` (k8s_files.py) writes the
first as a kustomize base and the second, for each device kind, as the ``cpu``
and ``gpu`` overlays. ``k8s/`` in the repository is ``kustomize_tree`` of
``examples/job.yaml``, written by ``zeroplane submit --out k8s --no-apply``;
tests check that it has not drifted, and that ``kubectl kustomize`` of each
overlay equals ``render`` of that device kind.

[Note: how the pieces find each other]
Workers reach the coordinator through its Service, ``<job>-coordinator:50051``
(``$ZEROPLANE_COORDINATOR``), with the bearer token from the ``<job>-token``
Secret (``$ZEROPLANE_TOKEN``; the coordinator reads the same variable); every
format's workers get the same environment from ``_worker_env``. Each worker
advertises an address the other ranks reach it at (``$ZEROPLANE_HOST``), which
is where they find the rendezvous store when it is rank 0: a Job's pod its
stable name under the headless Service, ``<job>-worker-<index>.<job>-workers``
(``publishNotReadyAddresses`` lets those names resolve before a pod is ready,
since the first generation forms while pods are still starting); a Kubeflow
pod, whose names its operator chooses, its IP. The coordinator keeps its state
file on a small PersistentVolumeClaim, so a restarted coordinator re-attaches
to the workers that kept training.

[Note: completion and elastic scaling]
A finished job completes: workers run ``zeroplane run`` without ``--hold``,
so each pod exits 0 once training is done, and the Indexed Job
``<job>-worker`` gets its ``Complete`` condition when every index has
(``kubectl wait --for=condition=complete job/<job>-worker``); the TrainJob's
``Complete`` and the PyTorchJob's ``Succeeded`` follow from their pods the
same way. A worker stopped before the end (SIGTERM) exits 128+15, so a pod
evicted mid-training is not a finished index: the Job starts it again
(``podFailurePolicy`` does not count disruptions against ``backoffLimit``).

An Indexed Job is elastic (Kubernetes >= 1.27): patching ``completions`` and
``parallelism`` together to N is the scaling interface. The coordinator is
started with the job's ``--min-workers`` and ``--max-workers`` (pods times
``device.count``): new pods register and join the next generation after the
join window; pods of the indexes a scale-down removes get SIGTERM and
``terminationGracePeriodSeconds`` to hand their shards over (the Job does not
count them as failed); pods beyond ``max`` wait as standbys, and below ``min``
the job waits. The Kubeflow formats run ``workers.replicas`` pods and are not
scaled through Kubernetes; the coordinator still carries the job over a lost
pod while at least ``min`` remain.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.core.meshplan import PP_ENV, TP_ENV
from coordinator.core.settings import (
    ADDRESS_ENV,
    HEALTH_PORT_ENV,
    METRICS_PORT_ENV,
    TLS_ROOT_CERT_ENV,
    TOKEN_FILE_ENV,
)
from coordinator.launchers.jobspec import COMPRESSION_ENV, HOST_ENV, WORKER_ID_ENV, JobSpec

__all__ = [
    "COORDINATOR_PORT",
    "KUBERNETES_VERSIONS",
    "base_objects",
    "coordinator_args",
    "dashboard_uid",
    "find_dashboard",
    "job_dashboard",
    "metrics_port_names",
    "object_meta",
    "render",
    "token_secret",
    "worker_args",
    "worker_objects",
]

logger = logging.getLogger(__name__)

# The Kubernetes versions the manifests are validated against (tests/test_k8s.py).
# One range, validated at both ends: podReplacementPolicy is on by default from 1.29
# (beta; GA in 1.34), and 1.37 is the newest schema kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.29", "1.37")

COORDINATOR_PORT = 50051
# /metrics of every pod (the coordinator's HTTP port also serves its status page).
METRICS_PORT = 9400
# /healthz of ``zeroplane run`` in each worker pod (the workers' liveness probe).
HEALTH_PORT = 9399
# The bearer token, a file of the token Secret (never an environment variable).
TOKEN_DIR = "/var/run/secrets/zeroplane"
STATE_DIR = "/var/lib/zeroplane"
CHECKPOINT_DIR = "/checkpoints"
# where JobSpec.tls_secret is mounted: the coordinator's certificate and key, the
# workers' trusted authority (ca.crt alone)
TLS_DIR = "/tls"
TMP_DIR = "/tmp"
# What the coordinator's health service reports on (coordinator/control/server.py's SERVICE_NAME;
# not imported from there, which would pull in grpc's server side to render YAML).
SERVICE_NAME = "zeroplane.coordinator.v1.Coordinator"
# Numeric, so that runAsNonRoot can be checked; the image creates this user.
RUN_AS = 10001
DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
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


def object_meta(spec: JobSpec, name: str, component: str | None = None) -> dict[str, Any]:
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
    **pod: Any,
) -> dict[str, Any]:
    """A hardened pod of one container: no service-account token, no service
    links, the restricted security context; ``pod``: more fields of its spec."""
    return {
        "metadata": {"labels": selector},
        "spec": {
            **pod,
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


def _token_env() -> dict[str, Any]:
    return {"name": TOKEN_FILE_ENV, "value": f"{TOKEN_DIR}/token"}


def _token_volume(spec: JobSpec) -> dict[str, Any]:
    """The token Secret as a file (0440: the pod's group, which fsGroup makes the
    non-root user's); what a process reads, not what ``kubectl describe`` shows."""
    secret = {"secretName": spec.token_secret, "defaultMode": 0o440}
    return {"name": "token", "secret": {**secret, "items": [{"key": "token", "path": "token"}]}}


_TOKEN_MOUNT = {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}


def _scratch(name: str, size: str, **kind: Any) -> dict[str, Any]:
    """An emptyDir with a size limit: a runaway writer is evicted, not the node's disk filled."""
    return {"name": name, "emptyDir": {**kind, "sizeLimit": size}}


def _from_scrapers(spec: JobSpec) -> dict[str, Any]:
    """Who may reach a metrics port: Prometheus' namespace, or any namespace."""
    if spec.metrics_from is None:
        return {}
    labels = {"kubernetes.io/metadata.name": spec.metrics_from}
    return {"from": [{"namespaceSelector": {"matchLabels": labels}}]}


def _network_policy(spec: JobSpec, component: str, ingress: list[Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(spec, f"{spec.name}-{component}", component),
        "spec": {
            "podSelector": {"matchLabels": _labels(spec, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
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
        # the PodMonitor's Prometheus scrapes the pod's address, not its loopback
        "--http-host",
        "0.0.0.0",
        # The job label of its metrics, as the PodMonitor gives the workers'.
        "--job-name",
        spec.name,
        *(
            # the status page and /sd name every worker: HTTPS, and the job's token
            [
                "--tls-cert",
                f"{TLS_DIR}/tls.crt",
                "--tls-key",
                f"{TLS_DIR}/tls.key",
                "--http-tls",
                "--http-auth",
            ]
            if spec.tls_secret is not None
            else []
        ),
    ]


def _tls_volume(spec: JobSpec, *, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """``spec.tls_secret`` as a volume: ``keys`` only, if given (0440: the pod's group,
    which fsGroup makes the non-root user's)."""
    secret: dict[str, Any] = {"secretName": spec.tls_secret, "defaultMode": 0o440}
    if keys is not None:
        secret["items"] = [{"key": k, "path": k} for k in keys]
    return {"name": "tls", "secret": secret}


def worker_args(spec: JobSpec) -> list[str]:
    """``zeroplane run`` arguments that start one pod's worker processes; the pod
    exits with the job's code once they have (see [Note: completion ...])."""
    return [
        "run",
        "--coordinator",
        f"$({ADDRESS_ENV})",
        "--nproc",
        str(spec.device.count),
        # SIGKILL from the launcher comes before the kubelet's.
        "--grace",
        str(max(spec.grace_period_s - 10, 5)),
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
    readiness: dict[str, Any] = {"grpc": {"port": COORDINATOR_PORT, "service": SERVICE_NAME}}
    liveness: dict[str, Any] = {"grpc": {"port": COORDINATOR_PORT}}
    if spec.tls_secret is not None:
        # the kubelet's gRPC probe speaks no TLS: /healthz over HTTPS (which the kubelet
        # does not verify) instead, the one path that asks for no token
        get = {"path": "/healthz", "port": "metrics", "scheme": "HTTPS"}
        readiness = liveness = {"httpGet": get}
    container = {
        "name": "coordinator",
        "image": spec.coordinator_image_ref,
        "args": coordinator_args(spec),
        "env": [_token_env(), {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [
            {"name": "grpc", "containerPort": COORDINATOR_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {**readiness, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            **liveness,
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
            _TOKEN_MOUNT,
            *([{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if spec.tls_secret else []),
        ],
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": object_meta(spec, spec.state_claim, "coordinator"),
            "spec": claim,
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": object_meta(spec, spec.coordinator, "coordinator"),
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
            "metadata": object_meta(spec, spec.coordinator, "coordinator"),
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
                        _scratch("tmp", "256Mi"),
                        _token_volume(spec),
                        *([_tls_volume(spec)] if spec.tls_secret is not None else []),
                    ],
                    grace_period_s=30,
                ),
            },
        },
        _network_policy(
            spec,
            "coordinator",
            [
                # The control plane: this job's workers only. (kubectl port-forward
                # and the kubelet's probes do not pass through NetworkPolicy.)
                {
                    "from": [{"podSelector": {"matchLabels": _labels(spec, "worker")}}],
                    "ports": [{"protocol": "TCP", "port": "grpc"}],
                },
                # Metrics, /sd and the status page: Prometheus' namespace (metrics_from).
                {**_from_scrapers(spec), "ports": [{"protocol": "TCP", "port": "metrics"}]},
            ],
        ),
    ]


# Kubeflow's APIs, as the schemas in tests/data/kubeflow validate them.
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_API = f"{TRAINER_GROUP}/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
# The label that marks the runtime's pod template a TrainJob's ``trainer`` fills in.
TRAINER_ANCESTOR = {f"{TRAINER_GROUP}/trainjob-ancestor-step": "trainer"}
# The worker container's name: Kubeflow's operators look for theirs by name.
CONTAINER_NAMES = {"job": "worker", "trainjob": "node", "pytorchjob": "pytorch"}
# Set by the Job controller on each pod of an Indexed Job.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _worker_env(spec: JobSpec) -> list[dict[str, Any]]:
    """The workers' environment, the same in every format but for how a pod names
    itself (see [Note: how the pieces find each other])."""
    if spec.format == "job":
        # An Indexed Job's pod has the hostname <job>-<index>; its name has a suffix.
        env = [_field_env("JOB_COMPLETION_INDEX", COMPLETION_INDEX)]
        pod = f"{spec.worker}-$(JOB_COMPLETION_INDEX)"
        host = f"{pod}.{spec.workers_service}"
    else:
        env = [_field_env("POD_NAME", "metadata.name"), _field_env("POD_IP", "status.podIP")]
        pod, host = "$(POD_NAME)", "$(POD_IP)"
    env += [
        {"name": ADDRESS_ENV, "value": f"{spec.coordinator}:{COORDINATOR_PORT}"},
        _token_env(),
        {"name": HOST_ENV, "value": host},
    ]
    if spec.tls_secret is not None:
        env.append({"name": TLS_ROOT_CERT_ENV, "value": f"{TLS_DIR}/ca.crt"})
    if spec.device.count == 1:
        # Several processes per pod fall back to <hostname>-<local rank>; one process
        # is named after its pod alone.
        env.append({"name": WORKER_ID_ENV, "value": pod})
    # Local rank i serves /metrics on METRICS_PORT + i, the pod's named ports
    # (metrics, metrics-1, ...), which the NetworkPolicy and the PodMonitor name.
    last = _last_metrics_port(spec)
    metrics_ports = str(METRICS_PORT) if last == METRICS_PORT else f"{METRICS_PORT}-{last}"
    env.append({"name": METRICS_PORT_ENV, "value": metrics_ports})
    env.append({"name": HEALTH_PORT_ENV, "value": str(HEALTH_PORT)})
    env.append({"name": COMPRESSION_ENV, "value": spec.compression})
    if spec.tensor_parallel * spec.pipeline_parallel > 1:
        env.append({"name": TP_ENV, "value": str(spec.tensor_parallel)})
        env.append({"name": PP_ENV, "value": str(spec.pipeline_parallel)})
    env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
    env += [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    return env


def _worker_resources(spec: JobSpec) -> dict[str, Any]:
    requests: dict[str, Any] = dict(spec.resources)
    limits: dict[str, Any] = {}
    if "memory" in spec.resources:
        limits["memory"] = spec.resources["memory"]
    if spec.device.kind == "cuda":
        requests[GPU_RESOURCE] = spec.device.count
        limits[GPU_RESOURCE] = spec.device.count
    return {"requests": requests, "limits": limits}


def metrics_port_names(spec: JobSpec) -> list[str]:
    """The worker pod's named metrics ports, one per local rank (METRICS_PORT + i)."""
    return ["metrics", *(f"metrics-{i}" for i in range(1, spec.device.count))]


def _last_metrics_port(spec: JobSpec) -> int:
    """The last of the worker pod's metrics ports, METRICS_PORT the first."""
    return METRICS_PORT + spec.device.count - 1


def _worker_pod(spec: JobSpec, **pod: Any) -> dict[str, Any]:
    """The pod template of a worker in the spec's format and device kind."""
    mounts = [
        {"name": "tmp", "mountPath": TMP_DIR},
        # NCCL and DataLoader workers need more shared memory than a container's 64 MiB.
        {"name": "dshm", "mountPath": "/dev/shm"},
        _TOKEN_MOUNT,
    ]
    volumes: list[dict[str, Any]] = [
        _scratch("tmp", spec.tmp_size),
        _scratch("dshm", spec.shm_limit, medium="Memory"),
        _token_volume(spec),
    ]
    if spec.checkpoint_storage is not None:
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint_claim}}
        )
    if spec.tls_secret is not None:
        # the authority that signed the coordinator's certificate, not its key
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(_tls_volume(spec, keys=["ca.crt"]))
    if spec.device.kind == "cuda":
        # GPU nodes are commonly tainted so that only GPU workloads land there.
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    ports = [
        {"name": name, "containerPort": METRICS_PORT + i, "protocol": "TCP"}
        for i, name in enumerate(metrics_port_names(spec))
    ]
    container = {
        "name": CONTAINER_NAMES[spec.format],
        "image": spec.worker_image,
        "args": worker_args(spec),
        "env": _worker_env(spec),
        "ports": [*ports, {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        # ``zeroplane run``'s /healthz answers while its loop over the workers turns
        # (coordinator/launchers/health.py); a hung collective is the coordinator's
        # to find, so that no probe restarts a pod the job could still carry.
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "health"},
            "initialDelaySeconds": 5,
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
        },
        "resources": _worker_resources(spec),
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    return _pod_template(
        _labels(spec, "worker"), container, volumes, grace_period_s=spec.grace_period_s, **pod
    )


def _worker_base_objects(spec: JobSpec) -> list[dict[str, Any]]:
    """What the workers need in every device kind: their claim, Service and budget."""
    selector = _labels(spec, "worker")
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
                "metadata": object_meta(spec, spec.checkpoint_claim, "worker"),
                "spec": claim,
            }
        )
    if spec.format == "job":
        # The Job's pods are <job>-worker-<index>.<job>-workers under it.
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": object_meta(spec, spec.workers_service, "worker"),
                "spec": {
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,
                    "selector": selector,
                },
            }
        )
    last = _last_metrics_port(spec)
    metrics: dict[str, Any] = {"protocol": "TCP", "port": METRICS_PORT}
    if last > METRICS_PORT:
        metrics["endPort"] = last
    objects.append(
        _network_policy(
            spec,
            "worker",
            [
                # gloo, NCCL and the rendezvous store listen on ports of their own
                # choosing, unauthenticated: this job's workers, and no one else.
                {"from": [{"podSelector": {"matchLabels": selector}}]},
                {**_from_scrapers(spec), "ports": [metrics]},
            ],
        )
    )
    objects.append(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": object_meta(spec, spec.worker, "worker"),
            "spec": {
                # Voluntary evictions (node drains) may take the job down to its minimum.
                "minAvailable": spec.workers.min,
                "selector": {"matchLabels": selector},
            },
        }
    )
    return objects


def worker_objects(spec: JobSpec) -> list[dict[str, Any]]:
    """The workers' workload in the spec's format, for its device kind."""
    replicas = spec.workers.replicas
    if spec.format == "trainjob":
        pod = _worker_pod(spec, restartPolicy="OnFailure")
        return [
            {
                "apiVersion": TRAINER_API,
                "kind": "TrainingRuntime",
                "metadata": object_meta(spec, spec.name, "worker"),
                "spec": {
                    # No torch policy: zeroplane, not torchrun, forms the process group.
                    "mlPolicy": {"numNodes": replicas},
                    "template": {
                        "spec": {
                            **_ttl(spec),
                            "replicatedJobs": [
                                {
                                    "name": "node",
                                    "template": {
                                        "metadata": {"labels": TRAINER_ANCESTOR},
                                        "spec": {"template": pod},
                                    },
                                }
                            ],
                        }
                    },
                },
            },
            {
                "apiVersion": TRAINER_API,
                "kind": "TrainJob",
                "metadata": object_meta(spec, spec.name, "worker"),
                "spec": {
                    "runtimeRef": {
                        "apiGroup": TRAINER_GROUP,
                        "kind": "TrainingRuntime",
                        "name": spec.name,
                    },
                    **_deadline(spec),
                    "trainer": {
                        "image": spec.worker_image,
                        "args": worker_args(spec),
                        "numNodes": replicas,
                        "resourcesPerNode": _worker_resources(spec),
                    },
                },
            },
        ]
    if spec.format == "pytorchjob":
        replica = {
            "replicas": replicas,
            "restartPolicy": "OnFailure",
            "template": _worker_pod(spec),
        }
        return [
            {
                "apiVersion": PYTORCHJOB_API,
                "kind": "PyTorchJob",
                "metadata": object_meta(spec, spec.name, "worker"),
                # Workers only: zeroplane's coordinator, not a master pod, forms the group.
                "spec": {
                    "pytorchReplicaSpecs": {"Worker": replica},
                    **({"runPolicy": run} if (run := {**_deadline(spec), **_ttl(spec)}) else {}),
                },
            }
        ]
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": object_meta(spec, spec.worker, "worker"),
            "spec": {
                # Elastic: completions and parallelism move together (see [Note: completion ...]).
                "completionMode": "Indexed",
                "completions": replicas,
                "parallelism": replicas,
                # One pod per index at a time: a replacement registers under the same name.
                "podReplacementPolicy": "Failed",
                **_deadline(spec),
                **_ttl(spec),
                "podFailurePolicy": {
                    "rules": [
                        {
                            "action": "Ignore",
                            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                        }
                    ]
                },
                "template": _worker_pod(
                    spec, restartPolicy="Never", subdomain=spec.workers_service
                ),
            },
        }
    ]


def _ttl(spec: JobSpec) -> dict[str, int]:
    if spec.ttl_after_finished_s is None:
        return {}
    return {"ttlSecondsAfterFinished": spec.ttl_after_finished_s}


def _deadline(spec: JobSpec) -> dict[str, int]:
    return {} if spec.deadline_s is None else {"activeDeadlineSeconds": spec.deadline_s}


def dashboard_uid(spec: JobSpec) -> str:
    """The job's Grafana dashboard uid: ``zeroplane-<job>`` within Grafana's 40 characters."""
    uid = f"zeroplane-{spec.name}"
    if len(uid) > 40:
        digest = hashlib.sha256(spec.name.encode()).hexdigest()[:8]
        uid = f"zeroplane-{spec.name[:21]}-{digest}"
    return uid


def job_dashboard(spec: JobSpec, dashboard: str) -> str:
    """The shipped dashboard as this job's own: its uid and title, its job preselected."""
    board = json.loads(dashboard)
    board["uid"] = dashboard_uid(spec)
    board["title"] = f"{board['title']} {spec.name}"
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("name") == "job":
            variable["current"] = {"text": spec.name, "value": spec.name}
    return json.dumps(board, indent=2) + "\n"


def _monitoring_objects(spec: JobSpec, dashboard: str | None) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    if spec.monitoring == "prometheus-operator":
        objects += _pod_monitors(spec)
    if dashboard is not None:
        meta = object_meta(spec, spec.dashboard)
        meta["labels"]["grafana_dashboard"] = "1"
        # Grafana's sidecar writes each key to a file: one file per job.
        data = {f"{dashboard_uid(spec)}.json": job_dashboard(spec, dashboard)}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    return objects


def _pod_monitors(spec: JobSpec) -> list[dict[str, Any]]:
    """The PodMonitor of the job's pods; with TLS, the coordinator's HTTPS and token
    in a second one (the workers' metrics stay plain HTTP)."""

    def monitor(name: str, selector: dict[str, str], ports: list[str], **endpoint: Any) -> Any:
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": object_meta(spec, name),
            "spec": {
                # Prometheus' job label becomes the zeroplane job's name.
                "jobLabel": "app.kubernetes.io/instance",
                "selector": {"matchLabels": selector},
                "podMetricsEndpoints": [
                    {"port": port, "path": "/metrics", "interval": "15s", **endpoint}
                    for port in ports
                ],
            },
        }

    ports = metrics_port_names(spec)
    if spec.tls_secret is None:
        return [monitor(spec.name, _labels(spec), ports)]
    token = {"name": spec.token_secret, "key": "token"}
    secure = {
        "scheme": "https",
        "authorization": {"type": "Bearer", "credentials": token},
        "tlsConfig": {
            "ca": {"secret": {"name": spec.tls_secret, "key": "ca.crt"}},
            "serverName": spec.coordinator,
        },
    }
    return [
        monitor(spec.name, _labels(spec, "worker"), ports),
        monitor(spec.coordinator, _labels(spec, "coordinator"), ["metrics"], **secure),
    ]


def token_secret(spec: JobSpec, token: str) -> dict[str, Any]:
    """The Secret holding the bearer token, as kustomize's secretGenerator makes it."""
    if not token.strip():
        raise ValueError("token must be non-empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(spec, spec.token_secret),
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
    """Every object but the token Secret and the workers' workload (``worker_objects``)."""
    return [
        *_coordinator_objects(spec),
        *_worker_base_objects(spec),
        *_monitoring_objects(spec, dashboard),
    ]


def render(
    spec: JobSpec, *, token: str | None = None, dashboard: str | None = None
) -> list[dict[str, Any]]:
    """The job's manifests for its device kind; the token Secret first when ``token`` is given."""
    objects = [*base_objects(spec, dashboard=dashboard), *worker_objects(spec)]
    if token is not None:
        objects.insert(0, token_secret(spec, token))
    return objects
