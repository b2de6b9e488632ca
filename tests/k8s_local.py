"""Run rendered Kubernetes manifests as local processes: a small stand-in for a cluster.

Each pod gets a network namespace of its own (and a UTS namespace: its
hostname is its name), on a bridge inside a "node" namespace that this module
creates and deletes, so every pod has its own address and ports exactly as in
a cluster (two workers both serve metrics on the port the manifest names).
Names resolve through a per-namespace ``/etc/hosts`` (``ip netns exec`` mounts
``/etc/netns/<ns>/hosts``), as cluster DNS would answer: ``<pod>.<headless
service>`` to the pod's address, a pod's own hostname to its address (as the
kubelet writes it), and a ClusterIP Service's name to a stable virtual address
on the node, where a small TCP proxy forwards to the Service's current pod
(kube-proxy's job), so a replaced pod keeps its Service's address. Nothing in
a command, an argument or an environment variable is rewritten for the
network.

Taken from the manifests exactly as written: each container's ``command``
(else the image's ENTRYPOINT, read from deploy/Dockerfile) and ``args`` (else
CMD), its ``env`` with ``$(VAR)`` expansion, ``secretKeyRef`` (from the
rendered Secret) and ``fieldRef``, Secret volumes (their keys as files), its
gRPC and HTTP probes, and the pod's
``terminationGracePeriodSeconds``. An Indexed Job's pods get what its
controller gives them (the completion-index annotation, the hostname
``<job>-<index>`` under the template's ``subdomain``), and the Job's
``Complete`` condition and elastic scaling are emulated as its controller
does them (:meth:`LocalCluster.job_complete`, :meth:`LocalCluster.scale_job`).
What stands in for the image and the kubelet, and is the only rewriting, is a
mapping of paths: the image's
``/opt/venv`` is this virtual environment, its working directory ``/app`` is
the repository (which is what the image copies), and each volume's
``mountPath`` is a directory of the pod's (a claim's directory outlives the
pod, as a PersistentVolumeClaim does). Processes run as the invoking user,
not ``runAsUser``.

Needs root (network namespaces): :func:`available` says whether it can run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
SUBNET = "10.244.0"
# Where the image keeps its virtual environment (deploy/Dockerfile).
IMAGE_VENV = "/opt/venv"
# The base image's own environment, which the Dockerfile's ENV builds on.
BASE_IMAGE_ENV = {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"}


def available() -> str | None:
    """None if this machine can run a LocalCluster; else why not."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    probe = f"zpk-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


# ---- the image ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """The runtime stage of deploy/Dockerfile, as far as running its containers needs."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    workdir: str
    user: str


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def read_image(path: Path = DOCKERFILE) -> Image:
    args: dict[str, str] = {}
    stage_args: dict[str, str] = {}
    env: dict[str, str] = {}
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    workdir, user = "/", "root"

    def subst(text: str) -> str:
        scope = {**BASE_IMAGE_ENV, **args, **stage_args, **env}
        return re.sub(r"\$\{?(\w+)\}?", lambda m: scope.get(m.group(1), ""), text)

    in_stage = False
    for word, rest in dockerfile_instructions(path):
        if word == "ARG":
            name, eq, default = rest.partition("=")
            if in_stage:  # a stage's ARG without a default takes the global one
                stage_args[name] = default if eq else args.get(name, "")
            else:
                args[name] = default
        elif word == "FROM":
            in_stage = True
            stage_args, env, entrypoint, cmd, workdir, user = {}, {}, (), (), "/", "root"
        elif word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = subst(v)
        elif word == "WORKDIR":
            workdir = subst(rest)
        elif word == "USER":
            user = rest
        elif word == "ENTRYPOINT":
            entrypoint = tuple(json.loads(rest))
        elif word == "CMD":
            cmd = tuple(json.loads(rest))
    return Image(entrypoint=entrypoint, cmd=cmd, env=env, workdir=workdir, user=user)


# ---- pods ---------------------------------------------------------------------------------


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names expand, ``$$`` escapes, others stay."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


# What the Job controller annotates an Indexed Job's pods with.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@dataclass
class Pod:
    name: str
    ip: str
    netns: str
    spec: dict[str, Any]
    paths: dict[str, Path]
    log: Path
    hostname: str = ""
    owner: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def container(self) -> dict[str, Any]:
        return self.spec["containers"][0]

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The container's exit code once it has exited."""
        return None if self.proc is None else self.proc.poll()

    def volume(self, mount_path: str) -> Path:
        return self.paths[mount_path]

    @property
    def index(self) -> int | None:
        value = self.annotations.get(COMPLETION_INDEX)
        return None if value is None else int(value)


class LocalCluster:
    """Pods of ``objects`` (as ``coordinator.launchers.k8s.render`` makes them) on this machine."""

    def __init__(self, objects: Sequence[Mapping[str, Any]], workdir: Path) -> None:
        self.objects = [dict(o) for o in objects]
        self.workdir = workdir
        self.namespace = "default"
        self.image = read_image()
        self.tag = f"zpk{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.node = f"{self.tag}-node"
        self.pods: dict[str, Pod] = {}
        self._next_ip = 10
        self._netns: list[str] = []
        # ClusterIP Services: a stable virtual address each, served by a TCP proxy on the
        # node that forwards to a current backend pod (what kube-proxy does).
        self._vips: dict[str, str] = {}
        self._proxies: list[subprocess.Popen] = []

    # ---- network -------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        try:
            self._netns_add(self.node)
            self._ip(self.node, "link", "set", "lo", "up")
            self._ip(self.node, "link", "add", "br0", "type", "bridge")
            # A fixed MAC: a bridge otherwise takes its lowest port's, which changes as pods
            # come and go and leaves the pods' ARP entries for the Service addresses stale.
            self._ip(self.node, "link", "set", "br0", "address", "02:00:0a:f4:00:01")
            self._ip(self.node, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
            self._ip(self.node, "link", "set", "br0", "up")
            self._start_service_proxies()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pod in self.pods.values():
            self._kill(pod)
        for proxy in self._proxies:
            proxy.kill()
            proxy.wait()
        self._proxies.clear()
        for ns in reversed(self._netns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._netns.clear()

    def _netns_add(self, name: str) -> None:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        self._netns.append(name)

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "ip", *args], check=True, capture_output=True)

    def _attach(self, ns: str) -> str:
        ip = f"{SUBNET}.{self._next_ip}"
        veth = f"v{self._next_ip}"
        self._next_ip += 1
        subprocess.run(
            [
                *("ip", "link", "add", veth, "netns", self.node, "type", "veth"),
                *("peer", "name", "eth0", "netns", ns),
            ],
            check=True,
            capture_output=True,
        )
        self._ip(self.node, "link", "set", veth, "master", "br0", "up")
        self._ip(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        self._ip(ns, "link", "set", "eth0", "up")
        self._ip(ns, "link", "set", "lo", "up")
        return ip

    def _names(self) -> dict[str, str]:
        """name -> address, as cluster DNS would answer inside the namespace."""
        names: dict[str, str] = {}
        suffix = f"{self.namespace}.svc.cluster.local"
        for svc in self._objects("Service"):
            name = svc["metadata"]["name"]
            selector = svc["spec"].get("selector", {})
            members = [p for p in self.pods.values() if _matches(p, selector)]
            if svc["spec"].get("clusterIP") == "None":
                # headless: a name for each pod whose subdomain it is
                for p in (p for p in members if p.spec.get("subdomain") == name):
                    for n in (f"{p.hostname}.{name}", f"{p.hostname}.{name}.{suffix}"):
                        names[n] = p.ip
            else:
                for n in (name, f"{name}.{self.namespace}", f"{name}.{suffix}"):
                    names[n] = self._vips[name]
        return names

    def _start_service_proxies(self) -> None:
        services = [s for s in self._objects("Service") if s["spec"].get("clusterIP") != "None"]
        for i, svc in enumerate(services):
            vip = f"{SUBNET}.{2 + i}"  # pods start at .10
            name = svc["metadata"]["name"]
            self._vips[name] = vip
            self._ip(self.node, "addr", "add", f"{vip}/24", "dev", "br0")
            for port in svc["spec"]["ports"]:
                backend = self._backend_file(name, port["port"])
                backend.parent.mkdir(parents=True, exist_ok=True)
                backend.write_text("")
                self._proxies.append(
                    subprocess.Popen(
                        [
                            *("ip", "netns", "exec", self.node, sys.executable),
                            *("-m", "tests.k8s_local", "proxy", vip, str(port["port"])),
                            str(backend),
                        ],
                        cwd=REPO,
                        stdin=subprocess.DEVNULL,
                    )
                )

    def _backend_file(self, service: str, port: int) -> Path:
        return self.workdir / "services" / f"{service}-{port}"

    def _update_backends(self) -> None:
        for svc in self._objects("Service"):
            name = svc["metadata"]["name"]
            if name not in self._vips:
                continue
            members = [p for p in self.pods.values() if _matches(p, svc["spec"]["selector"])]
            for port in svc["spec"]["ports"]:
                target = ""
                if members:
                    pod = members[-1]  # the newest
                    target = (
                        f"{pod.ip}:{_container_port(pod, port.get('targetPort', port['port']))}"
                    )
                self._backend_file(name, port["port"]).write_text(target)

    def _write_hosts(self) -> None:
        self._update_backends()
        names = [f"{ip} {name}" for name, ip in sorted(self._names().items())]
        own = {p.netns: p for p in self.pods.values()}
        for ns in self._netns:
            lines = ["127.0.0.1 localhost"]
            pod = own.get(ns)
            if pod is not None:  # the kubelet maps a pod's own hostname to its address
                lines.append(f"{pod.ip} {pod.hostname}")
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines + names) + "\n")

    # ---- objects -------------------------------------------------------------------------

    def _objects(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for o in self._objects(kind):
            if o["metadata"]["name"] == name:
                return o
        raise KeyError(f"no {kind} {name!r} in the manifests")

    def _secret(self, name: str, key: str) -> str:
        data = self.get("Secret", name)["data"]
        return base64.b64decode(data[key]).decode()

    # ---- pods ----------------------------------------------------------------------------

    def start(self, kind: str, name: str, index: int = 0) -> Pod:
        """Start a pod of the Deployment or Indexed Job ``name`` (``index``: its completion
        index), named as their controllers name them."""
        workload = self.get(kind, name)
        template = workload["spec"]["template"]
        suffix = f"{self._next_ip:05x}"
        annotations = {}
        if kind == "Job":
            if workload["spec"].get("completionMode") != "Indexed":
                raise NotImplementedError("only Indexed Jobs are emulated")
            if any(p.owner == name and p.index == index and p.running for p in self.pods.values()):
                raise RuntimeError(f"index {index} of Job {name} has a running pod")
            hostname, annotations = f"{name}-{index}", {COMPLETION_INDEX: str(index)}
            pod_name = f"{hostname}-{suffix}"
        else:
            pod_name = hostname = f"{name}-{suffix}"
        ns = f"{self.tag}-p{self._next_ip}"  # unique: addresses are never reused
        self._netns_add(ns)
        ip = self._attach(ns)
        pod = Pod(
            name=pod_name,
            ip=ip,
            netns=ns,
            spec=template["spec"],
            paths=self._volumes(pod_name, template["spec"]),
            log=self.workdir / "logs" / f"{pod_name}.log",
            hostname=hostname,
            owner=name,
            labels=dict(template["metadata"].get("labels", {})),
            annotations=annotations,
        )
        self.pods[pod_name] = pod
        self._write_hosts()
        self._launch(pod)
        return pod

    def _volumes(self, pod_name: str, spec: Mapping[str, Any]) -> dict[str, Path]:
        by_name: dict[str, Path] = {}
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                d = self.workdir / "claims" / v["persistentVolumeClaim"]["claimName"]
            else:
                d = self.workdir / "pods" / pod_name / v["name"]
                shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, exist_ok=True)
            if "secret" in v:  # the Secret's keys as files (``items``: only those)
                secret = v["secret"]
                data = self.get("Secret", secret["secretName"])["data"]
                items = secret.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    path = d / item["path"]
                    path.write_bytes(base64.b64decode(data[item["key"]]))
                    path.chmod(secret.get("defaultMode", 0o644) & 0o700)
            by_name[v["name"]] = d
        container = spec["containers"][0]
        paths = {m["mountPath"]: by_name[m["name"]] for m in container.get("volumeMounts", [])}
        return paths

    def _map_path(self, pod: Pod, value: str) -> str:
        mapping = {IMAGE_VENV: sys.prefix, self.image.workdir: str(REPO)} | {
            k: str(v) for k, v in pod.paths.items()
        }
        # One pass, longest prefix first: a mapped path is never mapped again.
        alternatives = "|".join(re.escape(p) for p in sorted(mapping, key=len, reverse=True))
        pattern = rf"(?<![\w.-])({alternatives})(?=/|$|[^\w.-])"
        return re.sub(pattern, lambda m: mapping[m.group(1)], value)

    def _field(self, pod: Pod, path: str) -> str:
        values = {
            "metadata.name": pod.name,
            "metadata.namespace": self.namespace,
            "status.podIP": pod.ip,
            "spec.nodeName": "local",
        }
        if annotation := re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path):
            return pod.annotations[annotation.group(1)]
        return values[path]

    def _launch(self, pod: Pod) -> None:
        c = pod.container
        env: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "secretKeyRef" in e["valueFrom"]:
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = self._secret(ref["name"], ref["key"])
            else:
                env[e["name"]] = self._field(pod, e["valueFrom"]["fieldRef"]["fieldPath"])
        command = c.get("command", list(self.image.entrypoint))
        args = c.get("args", list(self.image.cmd) if "command" not in c else [])
        argv = [expand(a, env) for a in [*command, *args]]
        # The image's environment first, then the container's, as a runtime does.
        full_env = {k: self._map_path(pod, v) for k, v in self.image.env.items()}
        full_env.update({k: self._map_path(pod, v) for k, v in env.items()})
        full_env.setdefault("PATH", f"{sys.prefix}/bin:/usr/bin:/bin")
        argv = [self._map_path(pod, a) for a in argv]
        program = shutil.which(argv[0], path=full_env["PATH"])
        if program is None:
            raise FileNotFoundError(f"{argv[0]!r} is not on the image's PATH {full_env['PATH']}")
        cwd = self._map_path(pod, c.get("workingDir", self.image.workdir))
        pod.argv, pod.env = argv, full_env
        pod.log.parent.mkdir(parents=True, exist_ok=True)
        with pod.log.open("ab") as log:
            pod.proc = subprocess.Popen(
                # A UTS namespace too: the pod's hostname is its name, as in a cluster.
                [
                    *("ip", "netns", "exec", pod.netns, "unshare", "--uts", "sh", "-c"),
                    'hostname "$0" && exec "$@"',
                    *(pod.hostname, program, *argv[1:]),
                ],
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def restart(self, pod: Pod) -> None:
        """Start the pod's container again in the same pod (same name, address and
        volumes), as the kubelet does after the container exited."""
        if pod.proc is not None and pod.proc.poll() is None:
            raise RuntimeError(f"pod {pod.name}'s container is still running")
        self._launch(pod)

    def stop(self, pod: Pod, *, grace: float | None = None) -> int:
        """SIGTERM, then SIGKILL after the pod's terminationGracePeriodSeconds; the exit code."""
        assert pod.proc is not None
        if grace is None:
            grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        with contextlib.suppress(ProcessLookupError):
            pod.proc.send_signal(signal.SIGTERM)
        try:
            code = pod.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._kill(pod)
            code = pod.proc.wait()
        # What the container started dies with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pod.proc.pid, signal.SIGKILL)
        return code

    def delete(self, pod: Pod, *, grace: float | None = None) -> int:
        """Stop the pod and remove it (its address and names go with it)."""
        # As in Kubernetes, a terminating pod leaves its Services' endpoints first.
        del self.pods[pod.name]
        self._write_hosts()
        code = self.stop(pod, grace=grace)
        subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / pod.netns, ignore_errors=True)
        self._netns.remove(pod.netns)
        self._write_hosts()
        return code

    def job_complete(self, name: str) -> bool:
        """The Job's ``Complete`` condition (what ``kubectl wait --for=condition=complete``
        waits for): each index in ``[0, completions)`` has a pod that exited 0."""
        completions = self.get("Job", name)["spec"]["completions"]
        done = {p.index for p in self.pods.values() if p.owner == name and p.exit_code == 0}
        return done >= set(range(completions))

    def scale_job(self, name: str, n: int) -> list[Pod]:
        """``kubectl patch job/NAME`` to ``completions = parallelism = n``, then what the
        Job controller does: pods start for the new indexes, and the pods of indexes at or
        above ``n`` are deleted. Returns the pods started."""
        job = self.get("Job", name)
        job["spec"]["completions"] = job["spec"]["parallelism"] = n
        for pod in [p for p in self.pods.values() if p.owner == name and p.index >= n]:
            self.delete(pod)
        have = {p.index for p in self.pods.values() if p.owner == name}
        return [self.start("Job", name, i) for i in range(n) if i not in have]

    def _kill(self, pod: Pod) -> None:
        if pod.proc is not None and pod.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pod.proc.pid, signal.SIGKILL)
            pod.proc.wait()

    # ---- what the kubelet and kubectl do -------------------------------------------------

    def node_run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on the node (the bridge's namespace): a probe, or a client
        standing in for ``kubectl port-forward``. It resolves the cluster's names."""
        self._write_hosts()
        return subprocess.run(
            ["ip", "netns", "exec", self.node, *argv],
            env={**os.environ, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def status_reader(self, address: str, token: str) -> StatusReader:
        """``zeroplane status --json`` from the node, as :meth:`node_run` would run it,
        from one client process kept for the cluster's life: a poll costs an RPC, not
        a Python start and gRPC's import (about a core-second on this machine)."""
        self._write_hosts()
        proc = subprocess.Popen(
            [
                *("ip", "netns", "exec", self.node, sys.executable),
                *("-m", "tests.k8s_local", "status", address),
            ],
            env={**os.environ, "ZEROPLANE_TOKEN": token},
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._proxies.append(proc)  # killed with the cluster
        return StatusReader(proc)

    def probe(self, pod: Pod, kind: str) -> bool:
        """Run the container's ``readinessProbe`` or ``livenessProbe`` once, as the kubelet does."""
        spec = pod.container[kind]
        if "httpGet" in spec:
            http = spec["httpGet"]
            port = http["port"]
            if isinstance(port, str):  # a named container port
                (port,) = [p["containerPort"] for p in pod.container["ports"] if p["name"] == port]
            # HTTPS as the kubelet does it: no certificate verification
            get = (
                "import ssl, sys, urllib.request\n"
                "context = ssl._create_unverified_context()\n"
                "r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]),"
                " context=context)\n"
                "sys.exit(0 if 200 <= r.status < 400 else 1)\n"
            )
            scheme = http.get("scheme", "HTTP").lower()
            url = f"{scheme}://{pod.ip}:{port}{http.get('path', '/')}"
            result = self.node_run(
                [sys.executable, "-c", get, url, str(spec.get("timeoutSeconds", 1))]
            )
            return result.returncode == 0
        if "grpc" not in spec:
            raise NotImplementedError(f"{kind}: only grpc and httpGet probes are emulated")
        grpc_probe = spec["grpc"]
        check = (
            "import sys, grpc\n"
            "from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\n"
            "ch = grpc.insecure_channel(sys.argv[1])\n"
            "r = g.HealthStub(ch).Check(h.HealthCheckRequest(service=sys.argv[2]),"
            " timeout=float(sys.argv[3]))\n"
            "sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)\n"
        )
        timeout = str(spec.get("timeoutSeconds", 1))
        target = f"{pod.ip}:{grpc_probe['port']}"
        result = self.node_run(
            [sys.executable, "-c", check, target, grpc_probe.get("service", ""), timeout]
        )
        return result.returncode == 0

    def wait_for(self, predicate: Any, timeout: float, what: str, pods: Sequence[Pod] = ()) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            for pod in pods:
                if pod.proc is not None and pod.proc.poll() is not None:
                    raise AssertionError(
                        f"pod {pod.name} exited with {pod.proc.returncode} while waiting for "
                        f"{what}:\n{pod.output()[-4000:]}"
                    )
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.output()[-3000:]}" for p in pods)
                raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")
            time.sleep(0.2)


def _matches(pod: Pod, selector: Mapping[str, str]) -> bool:
    return bool(selector) and all(pod.labels.get(k) == v for k, v in selector.items())


def _container_port(pod: Pod, target: int | str) -> int:
    if isinstance(target, int):
        return target
    for port in pod.container.get("ports", []):
        if port.get("name") == target:
            return int(port["containerPort"])
    raise KeyError(f"pod {pod.name} has no port named {target!r}")


@dataclass
class StatusReader:
    """One status client on the node: each :meth:`read` is a fresh connection's
    ``status`` RPC (a replaced coordinator behind its Service is found at once),
    answered as ``zeroplane status --json`` prints it."""

    proc: subprocess.Popen[str]

    def read(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the status client exited with {self.proc.poll()}"
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer


def _serve_status(address: str) -> None:
    """The node's status client (:meth:`LocalCluster.status_reader`): a line in, the
    coordinator's status out as one JSON line (an error as ``{"error": ...}``)."""
    import dataclasses

    from coordinator.control.client import ClientConfig, CoordinatorClient, CoordinatorError

    config = ClientConfig(address=address, token=os.environ["ZEROPLANE_TOKEN"])
    for _ in sys.stdin:
        client = CoordinatorClient(config)
        try:
            answer = dataclasses.asdict(client.status())
        except CoordinatorError as exc:
            answer = {"error": str(exc)}
        finally:
            client.close()
        print(json.dumps(answer, default=str), flush=True)


async def _proxy(host: str, port: int, backend_file: Path) -> None:
    """Forward connections to host:port to the address in ``backend_file`` (read per
    connection, so a replaced pod is picked up); no backend: the connection closes."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = backend_file.read_text().strip()
        try:
            if not target:
                raise OSError("no backend")
            to_host, _, to_port = target.rpartition(":")
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(to_host, int(to_port)), timeout=3
            )
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, host, port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__" and sys.argv[1:2] == ["proxy"]:
    asyncio.run(_proxy(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])))
if __name__ == "__main__" and sys.argv[1:2] == ["status"]:
    _serve_status(sys.argv[2])
