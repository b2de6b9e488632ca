"""The job spec behind ``zeroplane submit``: a short YAML file, validated into a JobSpec.

    spec = load_job_spec("job.yaml")   # JobSpecError names the file and the field

::

    name: gpt                              # required: names every object of the job
    image: registry/zeroplane:0.1.0-cpu    # required, pinned (a tag other than latest)
    script: examples/train_gpt.py          # required: each worker runs python SCRIPT ARGS
    args: ["--steps", "1000"]
    workers: {min: 2, max: 4, replicas: 4} # worker pods; replicas defaults to max
    stage: auto                            # or 0-3
    tensor_parallel: 1                     # tp and pp: the mesh (coordinator/core/meshplan.py)
    pipeline_parallel: 1
    device: {kind: cpu, count: 1}          # or cuda; processes (and GPUs) per pod
    resources: {cpu: "2", memory: 8Gi}     # per worker pod
    compression: none                      # or bf16, fp16, int8, onebit
    format: job                            # or trainjob, pytorchjob (Kubeflow)
    monitoring: none                       # or prometheus-operator (adds a PodMonitor)

and optionally ``namespace``, ``coordinator_image``, ``image_digests``,
``grace_period_s``, ``ttl_after_finished_s``, ``deadline_s``, ``tmp_size``,
``shm_size``, ``state_storage``, ``storage_class``, ``checkpoint_storage``,
``checkpoint_storage_class``, ``metrics_from``, ``tls_secret`` and ``env`` (see
:class:`JobSpec`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from coordinator.core.meshplan import PP_ENV, TP_ENV
from coordinator.core.settings import (
    ADDRESS_ENV,
    HEALTH_PORT_ENV,
    METRICS_PORT_ENV,
    TLS_ROOT_CERT_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    WORKER_ID_ENV,
)

__all__ = [
    "COMPRESSION_ENV",
    "FORMATS",
    "HOST_ENV",
    "MONITORING",
    "WORKER_ID_ENV",
    "Device",
    "JobSpec",
    "JobSpecError",
    "Workers",
    "load_job_spec",
    "parse_job_spec",
]

# What the manifests set in every worker (coordinator/launchers/k8s.py).
HOST_ENV = "ZEROPLANE_HOST"
COMPRESSION_ENV = "ZEROPLANE_COMPRESSION"

STAGES = ("auto", "0", "1", "2", "3")
COMPRESSIONS = ("none", "bf16", "fp16", "int8", "onebit")
DEVICE_KINDS = ("cpu", "cuda")
# How the workers are run: a Kubernetes Indexed Job, a Kubeflow Trainer v2 TrainJob,
# or a Kubeflow training-operator v1 PyTorchJob (coordinator/launchers/k8s.py).
FORMATS = ("job", "trainjob", "pytorchjob")
# prometheus-operator: a PodMonitor, which needs the Prometheus Operator's CRDs.
MONITORING = ("none", "prometheus-operator")
# Set by the manifests; a spec's ``env`` may not override them.
RESERVED_ENV = frozenset(
    {
        ADDRESS_ENV,
        TOKEN_ENV,
        TOKEN_FILE_ENV,
        HEALTH_PORT_ENV,
        HOST_ENV,
        WORKER_ID_ENV,
        COMPRESSION_ENV,
        METRICS_PORT_ENV,
        TP_ENV,
        PP_ENV,
        TLS_ROOT_CERT_ENV,
        "POD_NAME",
        "POD_IP",
        "JOB_COMPLETION_INDEX",
    }
)

_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# Names get "-coordinator-state" appended; 63 is the DNS label limit.
MAX_NAME = 40


class JobSpecError(ValueError):
    """A job spec that cannot be rendered; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class Workers:
    """Worker pods: ``replicas`` start, scaling stays in [min, max]."""

    min: int = 1
    max: int = 1
    replicas: int | None = None

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            _check(
                _is_int(getattr(self, name)) and getattr(self, name) >= 1,
                f"workers.{name}",
                "an integer >= 1",
                getattr(self, name),
            )
        _check(self.max >= self.min, "workers.max", f">= workers.min ({self.min})", self.max)
        if self.replicas is None:
            object.__setattr__(self, "replicas", self.max)
        _check(
            _is_int(self.replicas) and self.min <= self.replicas <= self.max,
            "workers.replicas",
            f"an integer in [workers.min, workers.max] = [{self.min}, {self.max}]",
            self.replicas,
        )


@dataclass(frozen=True, kw_only=True)
class Device:
    """What each worker pod trains on: ``count`` CPU processes or GPUs (one process each)."""

    kind: Literal["cpu", "cuda"] = "cpu"
    count: int = 1

    def __post_init__(self) -> None:
        _check(self.kind in DEVICE_KINDS, "device.kind", "cpu or cuda", self.kind)
        count = self.count
        _check(_is_int(count) and count >= 1, "device.count", "an integer >= 1", count)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job (see ``parse_job_spec`` for the YAML form).

    name: the job's name; objects are named ``<name>-coordinator``, ``<name>-worker``, ...
    image: the worker image for ``device.kind`` (``zeroplane:<version>-cpu`` or ``-cuda``).
    coordinator_image: default: ``image`` with a ``-cuda`` tag suffix made ``-cpu``
        (the coordinator needs no GPU and no torch).
    image_digests: ``{cpu: sha256:..., cuda: sha256:...}``, the digest of each
        variant's image: the manifests then name ``<image>@<digest>``, which a
        registry cannot move as it can a tag (``zeroplane submit`` warns about an
        image pinned by tag only). The coordinator's image is the cpu variant's.
    script / args: each worker process runs ``python SCRIPT ARGS`` in the image's
        working directory.
    stage: ``auto`` (the coordinator's planner picks) or 0-3.
    tensor_parallel / pipeline_parallel: the mesh's tp and pp, ``$ZEROPLANE_TP`` and
        ``$ZEROPLANE_PP`` in the workers; every worker count the job may run at
        (``workers`` times ``device.count`` processes) must be whole groups of tp*pp.
        A mesh job is elastic by whole groups; a count between them leaves the
        extra workers standing by.
    resources: per worker pod, ``cpu`` and ``memory`` as Kubernetes quantities.
    compression: gradient compression, ``$ZEROPLANE_COMPRESSION`` in the workers.
    grace_period_s: how long a worker pod gets between SIGTERM and SIGKILL to hand
        its shards over.
    ttl_after_finished_s: seconds a finished workload (Job, TrainJob's JobSet,
        PyTorchJob) is kept before Kubernetes deletes it and its pods (default 7
        days; None: kept until deleted).
    deadline_s: seconds the workload may run in all before Kubernetes stops it
        (``activeDeadlineSeconds``; default None: no limit).
    tmp_size / shm_size: the size limits of each worker pod's /tmp and /dev/shm
        (``emptyDir.sizeLimit``; /dev/shm is memory, counted against the pod's memory
        limit, which must hold it: by default half of ``resources.memory``, or 1Gi
        without one); the coordinator's /tmp is 256Mi.
    state_storage / storage_class: the coordinator's state claim.
    checkpoint_storage / checkpoint_storage_class: a ReadWriteMany claim mounted at
        /checkpoints in every worker (checkpoints need one directory all ranks share:
        pass ``--checkpoint /checkpoints`` to the script); None: no such volume.
    env: extra environment for the workers.
    metrics_from: the namespace Prometheus scrapes from: the NetworkPolicies then let
        only that namespace reach the metrics ports (and the coordinator's status
        page); None: any namespace may.
    format: how the workers run: ``job`` (an Indexed Job: completes when training
        does, scaled by patching its completions and parallelism), ``trainjob`` (a
        Kubeflow Trainer v2 TrainJob with its own TrainingRuntime) or ``pytorchjob``
        (a Kubeflow training-operator v1 PyTorchJob); the coordinator runs beside
        each as a Deployment.
    monitoring: ``prometheus-operator`` adds a PodMonitor (the Prometheus Operator's
        CRD); ``none`` renders only objects every cluster knows.
    tls_secret: a ``kubernetes.io/tls`` Secret (``tls.crt``, ``tls.key``, ``ca.crt``:
        what cert-manager's Certificate writes) for the coordinator's name
        ``<name>-coordinator``: the coordinator serves TLS with it, the workers trust
        its ``ca.crt`` (and see nothing else of it), and its HTTP port (status page,
        ``/api/status``, ``/sd``, ``/metrics``) serves HTTPS and asks for the job's
        token (``/healthz`` excepted). None: plaintext.
    """

    name: str
    image: str
    script: str
    args: tuple[str, ...] = ()
    namespace: str | None = None
    coordinator_image: str | None = None
    image_digests: Mapping[str, str] = field(default_factory=dict)
    workers: Workers = field(default_factory=Workers)
    stage: str = "auto"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    device: Device = field(default_factory=Device)
    resources: Mapping[str, str] = field(default_factory=lambda: {"cpu": "1", "memory": "2Gi"})
    compression: str = "none"
    grace_period_s: int = 120
    ttl_after_finished_s: int | None = 7 * 24 * 3600
    deadline_s: int | None = None
    tmp_size: str = "4Gi"
    shm_size: str | None = None
    state_storage: str = "1Gi"
    storage_class: str | None = None
    checkpoint_storage: str | None = None
    checkpoint_storage_class: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    metrics_from: str | None = None
    format: Literal["job", "trainjob", "pytorchjob"] = "job"
    monitoring: Literal["none", "prometheus-operator"] = "none"
    tls_secret: str | None = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.name, str)
            and _NAME.fullmatch(self.name) is not None
            and len(self.name) <= MAX_NAME,
            "name",
            f"a lowercase DNS label (a-z, 0-9, '-'; starting with a letter) of at most "
            f"{MAX_NAME} characters",
            self.name,
        )
        if self.namespace is not None:
            _check(
                isinstance(self.namespace, str)
                and _NAME.fullmatch(self.namespace) is not None
                and len(self.namespace) <= 63,
                "namespace",
                "a lowercase DNS label",
                self.namespace,
            )
        _check_image("image", self.image)
        if self.coordinator_image is None:
            object.__setattr__(self, "coordinator_image", _variant_image(self.image, "cpu"))
        _check_image("coordinator_image", self.coordinator_image)
        _check(
            isinstance(self.image_digests, Mapping),
            "image_digests",
            "a mapping of cpu/cuda to sha256:<64 hex digits>",
            self.image_digests,
        )
        for kind, digest in self.image_digests.items():
            _check(kind in DEVICE_KINDS, f"image_digests.{kind}", "cpu or cuda", kind)
            _check(
                isinstance(digest, str) and _DIGEST.fullmatch(digest) is not None,
                f"image_digests.{kind}",
                "sha256:<64 lowercase hex digits>",
                digest,
            )
        _check(
            not self.image_digests or "@" not in self.image,
            "image",
            "a reference without a digest where image_digests gives them",
            self.image,
        )
        object.__setattr__(self, "image_digests", dict(self.image_digests))
        _check(
            isinstance(self.script, str) and self.script.strip() != "",
            "script",
            "a non-empty path",
            self.script,
        )
        _check(
            isinstance(self.args, list | tuple) and all(isinstance(a, str) for a in self.args),
            "args",
            "a list of strings (quote numbers)",
            self.args,
        )
        object.__setattr__(self, "args", tuple(self.args))
        _check(isinstance(self.workers, Workers), "workers", "a Workers", self.workers)
        stage = str(self.stage) if _is_int(self.stage) else self.stage
        _check(stage in STAGES, "stage", "auto, 0, 1, 2 or 3", self.stage)
        object.__setattr__(self, "stage", stage)
        _check(isinstance(self.device, Device), "device", "a Device", self.device)
        for name in ("tensor_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, "an integer >= 1", value)
        group = self.tensor_parallel * self.pipeline_parallel
        for name in ("min", "max", "replicas"):
            procs = getattr(self.workers, name) * self.device.count
            _check(
                procs % group == 0,
                f"workers.{name}",
                f"a worker count whose {procs} processes are whole model-parallel groups of "
                f"tensor_parallel*pipeline_parallel = {group}",
                getattr(self.workers, name),
            )
        _check(isinstance(self.resources, Mapping), "resources", "a mapping", self.resources)
        for key, value in self.resources.items():
            _check(key in ("cpu", "memory"), f"resources.{key}", "one of cpu, memory", key)
            _check(
                isinstance(value, str) and _QUANTITY.fullmatch(value) is not None,
                f"resources.{key}",
                "a Kubernetes quantity such as '2', '500m' or '8Gi' (quoted)",
                value,
            )
        object.__setattr__(self, "resources", dict(self.resources))
        _check(
            self.compression in COMPRESSIONS,
            "compression",
            ", ".join(COMPRESSIONS),
            self.compression,
        )
        _check(
            _is_int(self.grace_period_s) and 10 <= self.grace_period_s <= 3600,
            "grace_period_s",
            "an integer number of seconds in [10, 3600]",
            self.grace_period_s,
        )
        for name in ("ttl_after_finished_s", "deadline_s"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= (1 if name == "deadline_s" else 0)),
                name,
                "a whole number of seconds" + (" >= 1" if name == "deadline_s" else " >= 0"),
                value,
            )
        for name in ("state_storage", "checkpoint_storage", "tmp_size", "shm_size"):
            value = getattr(self, name)
            if value is not None or name not in ("checkpoint_storage", "shm_size"):
                _check(
                    isinstance(value, str) and _QUANTITY.fullmatch(value),
                    name,
                    "a Kubernetes quantity such as '1Gi' (quoted)",
                    value,
                )
        for name in ("storage_class", "checkpoint_storage_class"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, str) and value != "", name, "a non-empty string", value)
        _check(isinstance(self.env, Mapping), "env", "a mapping of names to strings", self.env)
        for key, value in self.env.items():
            _check(
                isinstance(key, str) and _ENV_NAME.fullmatch(key) is not None,
                f"env.{key}",
                "a variable name (letters, digits, '_')",
                key,
            )
            _check(key not in RESERVED_ENV, f"env.{key}", "a name the manifests do not set", key)
            _check(isinstance(value, str), f"env.{key}", "a string (quote numbers)", value)
        object.__setattr__(self, "env", dict(self.env))
        memory = self.resources.get("memory")
        if memory is not None and self.shm_size is not None:
            _check(
                quantity_bytes(self.shm_size) < quantity_bytes(memory),
                "shm_size",
                f"less than resources.memory ({memory}): /dev/shm is the pod's memory",
                self.shm_size,
            )
        if self.metrics_from is not None:
            _check(
                isinstance(self.metrics_from, str)
                and _NAME.fullmatch(self.metrics_from) is not None
                and len(self.metrics_from) <= 63,
                "metrics_from",
                "a namespace's name (a lowercase DNS label)",
                self.metrics_from,
            )
        _check(self.format in FORMATS, "format", ", ".join(FORMATS), self.format)
        _check(
            self.monitoring in MONITORING, "monitoring", " or ".join(MONITORING), self.monitoring
        )
        if self.tls_secret is not None:
            _check(
                isinstance(self.tls_secret, str)
                and _NAME.fullmatch(self.tls_secret) is not None
                and len(self.tls_secret) <= 253,
                "tls_secret",
                "the name of a Secret (a lowercase DNS name)",
                self.tls_secret,
            )

    # ---- derived names ----------------------------------------------------------------

    @property
    def coordinator(self) -> str:
        return f"{self.name}-coordinator"

    @property
    def worker(self) -> str:
        return f"{self.name}-worker"

    @property
    def workers_service(self) -> str:
        return f"{self.name}-workers"

    @property
    def token_secret(self) -> str:
        return f"{self.name}-token"

    @property
    def state_claim(self) -> str:
        return f"{self.name}-coordinator-state"

    @property
    def checkpoint_claim(self) -> str:
        return f"{self.name}-checkpoints"

    @property
    def dashboard(self) -> str:
        return f"{self.name}-grafana-dashboard"

    @property
    def min_processes(self) -> int:
        return self.workers.min * self.device.count

    @property
    def max_processes(self) -> int:
        return self.workers.max * self.device.count

    @property
    def shm_limit(self) -> str:
        """/dev/shm's size limit: ``shm_size``, else half the pod's memory, else 1Gi."""
        if self.shm_size is not None:
            return self.shm_size
        memory = self.resources.get("memory")
        if memory is None:
            return "1Gi"
        return f"{max(int(quantity_bytes(memory) / 2 / 2**20), 1)}Mi"

    @property
    def worker_image(self) -> str:
        """The workers' image as the manifests name it: with its digest, if given."""
        return _pinned(self.image, self.image_digests.get(self.device.kind))

    @property
    def coordinator_image_ref(self) -> str:
        """The coordinator's image as the manifests name it (the cpu variant's digest,
        where the coordinator runs the cpu variant of ``image``)."""
        image = self.coordinator_image
        assert image is not None  # set in __post_init__
        if image == _variant_image(self.image, "cpu"):
            return _pinned(image, self.image_digests.get("cpu"))
        return image

    def for_device(self, kind: str) -> JobSpec:
        """This job on ``kind``: the image's ``-cpu``/``-cuda`` tag suffix follows."""
        if kind == self.device.kind:
            return self
        return replace(
            self,
            image=_variant_image(self.image, kind),
            device=Device(kind=kind, count=self.device.count),  # type: ignore[arg-type]
        )


# ---- parsing ----------------------------------------------------------------------------

_TOP = frozenset(f.name for f in dataclasses.fields(JobSpec))


def parse_job_spec(data: Any) -> JobSpec:
    """A JobSpec from the mapping a job YAML file holds (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise JobSpecError(f"job spec must be a mapping of fields, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - _TOP)
    if unknown:
        raise JobSpecError(
            f"job spec field {unknown[0]!r} is unknown (known: {', '.join(sorted(_TOP))})"
        )
    for required in ("name", "image", "script"):
        if data.get(required) in (None, ""):
            raise JobSpecError(f"job spec field {required!r} is required")
    fields: dict[str, Any] = dict(data)
    fields["workers"] = _sub(Workers, "workers", data.get("workers", {}))
    fields["device"] = _sub(Device, "device", data.get("device", {}))
    if fields.get("args") is None:
        fields["args"] = ()
    try:
        return JobSpec(**fields)
    except JobSpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise JobSpecError(f"job spec: {exc}") from None


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file; JobSpecError names the file and the field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise JobSpecError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise JobSpecError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse_job_spec(data)
    except JobSpecError as exc:
        raise JobSpecError(f"{path}: {exc}") from None


def _sub(cls: type, prefix: str, data: Any) -> Any:
    keys = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(data, Mapping):
        raise JobSpecError(
            f"job spec field {prefix!r} must be a mapping with {', '.join(keys)}, got {data!r}"
        )
    unknown = sorted(set(map(str, data)) - set(keys))
    if unknown:
        raise JobSpecError(
            f"job spec field '{prefix}.{unknown[0]}' is unknown (known: {', '.join(keys)})"
        )
    return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: Any, name: str, want: str, got: Any) -> None:
    if not ok:
        raise JobSpecError(f"job spec field {name!r} must be {want}, got {got!r}")


def _check_image(name: str, image: Any) -> None:
    _check(
        isinstance(image, str) and image != "" and not re.search(r"\s", image),
        name,
        "an image reference",
        image,
    )
    tail = image.rsplit("/", 1)[-1]
    pinned = "@sha256:" in image or (":" in tail and not tail.endswith(":latest"))
    _check(pinned, name, "pinned to a tag other than latest, or to a digest", image)


# Binary and decimal suffixes of a Kubernetes quantity; "m" is thousandths.
_UNITS = {
    **{u: 1024 ** (i + 1) for i, u in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{u: 1000 ** (i + 1) for i, u in enumerate(("k", "M", "G", "T", "P", "E"))},
    "m": 1e-3,
    "": 1,
}


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes quantity as a number (``"1Gi"`` -> 1073741824)."""
    match = _QUANTITY.fullmatch(quantity)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    unit = match.group(2) or ""
    return float(quantity[: len(quantity) - len(unit)]) * _UNITS[unit]


def _pinned(image: str, digest: str | None) -> str:
    return image if digest is None else f"{image}@{digest}"


def _variant_image(image: str, kind: str) -> str:
    suffix = {"cpu": "-cpu", "cuda": "-cuda"}
    if "@" in image:
        return image
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image
    for other in suffix.values():
        if tag.endswith(other):
            return f"{repo}:{tag.removesuffix(other)}{suffix[kind]}"
    return image
