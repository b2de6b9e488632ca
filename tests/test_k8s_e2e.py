"""The rendered manifests run as written: coordinator and worker pods as local processes,
scaled as the Job is scaled, until the worker Job completes.

tests/k8s_local.py stands in for the cluster (a network namespace per pod,
names resolved through /etc/hosts, volumes as directories); what each pod
runs, and with which environment, comes from the manifests unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import signal
import sys
from pathlib import Path

import pytest
import torch

from coordinator.launchers.jobspec import JobSpec, Workers
from coordinator.launchers.k8s import render
from tests.k8s_local import LocalCluster, Pod, StatusReader, available
from tests.test_mesh_elastic import reference as mesh_reference
from tests.test_run_e2e import reference
from tests.test_tls import tls_secret

why_not = available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=why_not or "")


SLOW_UNTIL_HURRY = ("--step-sleep", "0.25", "--step-sleep-until", "/tmp/hurry")


def job(steps: int, **kw: object) -> JobSpec:
    return JobSpec(
        name="e2e",
        image="zeroplane:0.1.0-cpu",
        script="examples/train_gpt.py",
        args=("--steps", str(steps), "--out", "/tmp/final.pt"),
        workers=Workers(min=2, max=3, replicas=2),
        resources={"cpu": "1", "memory": "1Gi"},
        grace_period_s=30,
        # a PodMonitor, for scrape() to read its endpoint from
        monitoring="prometheus-operator",
        **kw,
    )


def status(cluster: LocalCluster, token: str, ca: Path | None = None) -> dict:
    """``zeroplane status --json`` from the node, through the coordinator's Service name
    (what a user gets through ``kubectl port-forward``); ``ca``: over TLS, trusting it."""
    env = {"ZEROPLANE_TOKEN": token}
    if ca is not None:
        env["ZEROPLANE_TLS_ROOT_CERT"] = str(ca)
    result = cluster.node_run(
        ["zeroplane", "status", "--coordinator", "e2e-coordinator:50051", "--json"],
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_complete(
    cluster: LocalCluster, workers: list[Pod], others: list[Pod], timeout: float
) -> None:
    """``kubectl wait --for=condition=complete job/e2e-worker``: each index's pod exits 0
    by itself once training is done (a worker that exits otherwise fails at once)."""

    def complete() -> bool:
        for w in workers:
            assert w.exit_code in (None, 0), f"{w.name} exited {w.exit_code}:\n{w.output()[-4000:]}"
        return cluster.job_complete("e2e-worker")

    cluster.wait_for(complete, timeout, "the Job's Complete condition", others)


def scrape(cluster: LocalCluster, pod: Pod, ca: Path | None = None) -> str:
    """GET the pod's metrics as the PodMonitor that selects it says: port name, path,
    scheme, the bearer token from its Secret and the server name (``ca``: the authority
    its tlsConfig names, as a file)."""
    (monitor,) = [
        m
        for m in cluster._objects("PodMonitor")
        if m["spec"]["selector"]["matchLabels"].items() <= pod.labels.items()
    ]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in pod.container["ports"] if p["name"] == endpoint["port"]]
    https = endpoint.get("scheme", "http") == "https"
    headers = {}
    if "authorization" in endpoint:
        credentials = endpoint["authorization"]["credentials"]
        token = cluster._secret(credentials["name"], credentials["key"])
        headers["Authorization"] = f"Bearer {token}"
    # Prometheus connects to the pod's address and verifies the certificate for the
    # endpoint's serverName against the authority its tlsConfig names
    get = (
        "import http.client, json, socket, ssl, sys\n"
        "ip, port, path, headers, ca, name = sys.argv[1:]\n"
        "if ca:\n"
        "    context = ssl.create_default_context(cafile=ca)\n"
        "    sock = context.wrap_socket(socket.create_connection((ip, int(port))),"
        " server_hostname=name)\n"
        "    conn = http.client.HTTPConnection(ip, int(port))\n"
        "    conn.sock = sock\n"
        "else:\n"
        "    conn = http.client.HTTPConnection(ip, int(port))\n"
        "conn.request('GET', path, headers=json.loads(headers))\n"
        "response = conn.getresponse()\n"
        "assert response.status == 200, response.status\n"
        "print(response.read().decode())\n"
    )
    server_name = endpoint.get("tlsConfig", {}).get("serverName", "")
    args = [
        pod.ip,
        str(port["containerPort"]),
        endpoint["path"],
        json.dumps(headers),
        str(ca) if https and ca else "",
        server_name,
    ]
    assert not https or ca, "an HTTPS endpoint needs the authority to trust"
    result = cluster.node_run([sys.executable, "-c", get, *args])
    assert result.returncode == 0, f"{args}: {result.stderr}"
    return result.stdout


@pytest.mark.timeout(240)
def test_manifests_run_as_written_train_and_complete(tmp_path: Path) -> None:
    # with TLS on: the coordinator serves the Secret's certificate, the workers trust its
    # ca.crt (what a cert-manager Certificate for <job>-coordinator writes)
    token = secrets.token_hex(16)
    secret, ca_pem = tls_secret("e2e-coordinator-tls", ("e2e-coordinator", "localhost"))
    ca = tmp_path / "ca.crt"
    ca.write_bytes(ca_pem)
    objects = [
        secret,
        *render(job(steps=8, stage="2", tls_secret="e2e-coordinator-tls"), token=token),
    ]
    with LocalCluster(objects, tmp_path) as cluster:
        coordinator = cluster.start("Deployment", "e2e-coordinator")
        cluster.wait_for(
            lambda: cluster.probe(coordinator, "readinessProbe"),
            60,
            "the coordinator's readiness probe",
            [coordinator],
        )
        assert cluster.probe(coordinator, "livenessProbe")
        # HTTPS and the token, as the coordinator's PodMonitor scrapes it
        assert 'zeroplane_coordinator_info{job_name="e2e"' in scrape(cluster, coordinator, ca)

        workers = [cluster.start("Job", "e2e-worker", i) for i in range(2)]
        # the launcher's /healthz answers the workers' liveness probe
        cluster.wait_for(
            lambda: all(cluster.probe(w, "livenessProbe") for w in workers),
            60,
            "the workers' liveness probes",
            [coordinator, *workers],
        )
        wait_complete(cluster, workers, [coordinator], 180)
        report = status(cluster, token, ca)
        generations = [e for e in report["events"] if e["kind"] == "generation"]
        assert generations and "world size 2, stage 2" in generations[0]["detail"]
        # both pods registered under their pod names, advertising their stable DNS names
        registered = {
            e["worker_id"]: e["detail"] for e in report["events"] if e["kind"] == "registered"
        }
        assert registered == {
            f"e2e-worker-{i}": f"host e2e-worker-{i}.e2e-workers" for i in range(2)
        }

        # rank 0 (whichever pod it was) wrote the parameters: equal to one process's
        outs = [p for w in workers if (p := w.volume("/tmp") / "final.pt").exists()]
        assert len(outs) == 1
        got = torch.load(outs[0], weights_only=True)
        want = reference(8, 12)
        assert got.keys() == want.keys()
        assert max((got[k] - want[k]).abs().max().item() for k in got) < 1e-5

        # the coordinator stays up for `zeroplane status` until the job is deleted, and
        # exits 0 on the SIGTERM of its pod's deletion
        assert cluster.stop(coordinator) == 0, coordinator.output()[-2000:]


def steps(reader: StatusReader) -> tuple[int, int]:
    """(world size, the slowest member's step) as the coordinator reports them."""
    report = reader.read()
    members = [w for w in report["workers"] if w["state"] == "member"]
    done = [(w["report"] or {}).get("step", 0) for w in members]
    return report["world_size"], min(done, default=0)


@pytest.mark.timeout(300)
def test_scaling_and_a_coordinator_restart_keep_the_training_exact(tmp_path: Path) -> None:
    """kubectl scale up and down, and a replaced coordinator pod, in one run that must
    still end with the single-process parameters (SGD: see tests/test_elastic_e2e.py)."""
    # room for a third pod that starts slowly on a loaded machine (the job trains
    # on meanwhile); the coordinator's restart does not count: training is held
    total = 160
    token = secrets.token_hex(16)
    spec = job(steps=total, stage="2")
    # train_gpt.py that waits while /tmp/hold exists: however slow the coordinator's
    # restart on a loaded machine, the job is mid-training when it is scaled down
    spec = dataclasses.replace(
        spec,
        script="tests/scripts/held_train.py",
        # slow steps until /tmp/hurry exists: those after the scale-down run at full speed
        args=(*spec.args, "--optimizer", "sgd", *SLOW_UNTIL_HURRY),
    )
    objects = render(spec, token=token)
    with LocalCluster(objects, tmp_path) as cluster:
        first = cluster.start("Deployment", "e2e-coordinator")
        cluster.wait_for(lambda: cluster.probe(first, "readinessProbe"), 60, "ready", [first])
        polls = cluster.status_reader("e2e-coordinator:50051", token)
        workers = [cluster.start("Job", "e2e-worker", i) for i in range(2)]
        all_pods = [first, *workers]
        cluster.wait_for(lambda: steps(polls)[1] >= 2, 120, "training", all_pods)
        for pod in workers:  # each worker serves /metrics where the PodMonitor looks
            assert "zeroplane_model_state_bytes{" in scrape(cluster, pod)

        # kubectl patch job/e2e-worker to completions = parallelism = 3: index 2 joins
        (third,) = cluster.scale_job("e2e-worker", 3)
        # three members, the newcomer among them past a step of its own: what the
        # restarted coordinator must hear again below
        cluster.wait_for(
            lambda: (s := steps(polls))[0] == 3 and s[1] > 0,
            120,
            "three ranks training",
            [*all_pods, third],
        )

        # the coordinator's pod is replaced (Recreate: the old one goes first); the new
        # one, at a new address behind the same Service, restores from the claim
        hold = workers[0].volume("/tmp") / "hold"
        hold.touch()
        assert cluster.delete(first) == 0
        second = cluster.start("Deployment", "e2e-coordinator")
        cluster.wait_for(lambda: cluster.probe(second, "readinessProbe"), 60, "ready", [second])
        live = [second, *workers, third]
        cluster.wait_for(
            lambda: (s := steps(polls))[0] == 3 and s[1] > 0,
            60,
            "the workers' heartbeats in the restarted coordinator",
            live,
        )
        assert status(cluster, token)["events"][0]["kind"] == "restored"
        hold.unlink()

        # back to 2: the pod of index 2 gets SIGTERM and hands over; stopped before the
        # end, it exits 128+15, never a completed index (an evicted pod is started again)
        assert steps(polls)[1] < total - 10, "the job is too fast to scale it down"
        assert cluster.scale_job("e2e-worker", 2) == []
        assert "handed over" in third.output(), third.output()[-3000:]
        assert third.exit_code == 128 + signal.SIGTERM
        for pod in workers:
            (pod.volume("/tmp") / "hurry").touch()
        wait_complete(cluster, workers, [second], 180)
        events = status(cluster, token)["events"]
        assert not [e for e in events if e["kind"] == "registered"], "nobody re-registered"
        outs = [p for w in workers if (p := w.volume("/tmp") / "final.pt").exists()]
        assert len(outs) == 1
        got = torch.load(outs[0], weights_only=True)
        want = reference(total, 12, optimizer="sgd")
        # after 160 steps the summation order alone (2 or 3 ranks against one
        # process) moves a parameter by up to 6.5e-5 (measured, uninterrupted runs);
        # one step lost or repeated moves it by 1.4e-2
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-3
        assert cluster.stop(second) == 0


@pytest.mark.timeout(300)
def test_a_mesh_job_scales_by_whole_groups_of_pods(tmp_path: Path) -> None:
    """tp=2 from the job spec: the Indexed Job scaled from 2 pods to 4 adds a whole tp
    group, and back to 2 takes it away again (both of its pods get SIGTERM), with the
    first group never restarted; the parameters equal one process's."""
    total = 60
    token = secrets.token_hex(16)
    spec = dataclasses.replace(
        job(steps=total),
        script="tests/scripts/mesh_elastic_train.py",
        # the script's output directory is the pod's /tmp; steps are paced (0.5 s)
        # until /tmp/hurry exists
        args=("/tmp", "--steps", str(total), "--stage", "1", "--step-sleep", "0.5"),
        workers=Workers(min=2, max=4, replicas=2),
        tensor_parallel=2,
    )
    with LocalCluster(render(spec, token=token), tmp_path) as cluster:
        coordinator = cluster.start("Deployment", "e2e-coordinator")
        cluster.wait_for(
            lambda: cluster.probe(coordinator, "readinessProbe"), 60, "ready", [coordinator]
        )
        polls = cluster.status_reader("e2e-coordinator:50051", token)
        workers = [cluster.start("Job", "e2e-worker", i) for i in range(2)]
        first = [coordinator, *workers]
        cluster.wait_for(lambda: steps(polls)[1] >= 2, 120, "training", first)

        new = cluster.scale_job("e2e-worker", 4)
        assert len(new) == 2
        cluster.wait_for(lambda: steps(polls)[0] == 4, 120, "four ranks", first + new)
        report = status(cluster, token)
        assert report["mesh"] == {"pp": 1, "dp": 2, "tp": 2}
        # rank = dp * tp + tp_index at pp=1 (coordinator/core/meshplan.py [Note: mesh rank order])
        coords = {w["info"]["worker_id"]: divmod(w["rank"], 2) for w in report["workers"]}
        # the first group kept dp 0; the new pods are the other group, one at each tp
        assert sorted(coords[p.hostname] for p in workers) == [(0, 0), (0, 1)], coords
        assert sorted(coords[p.hostname] for p in new) == [(1, 0), (1, 1)], coords

        assert steps(polls)[1] < total - 10, "the job is too fast to scale it down"
        assert cluster.scale_job("e2e-worker", 2) == []
        for pod in new:
            assert pod.exit_code == 128 + signal.SIGTERM, pod.output()[-3000:]
        assert any("left the job: asked to leave" in p.output() for p in new)
        for pod in workers:
            (pod.volume("/tmp") / "hurry").touch()
        wait_complete(cluster, workers, [coordinator], 180)
        events = status(cluster, token)["events"]
        registered = sorted(e["worker_id"] for e in events if e["kind"] == "registered")
        assert registered == sorted(p.hostname for p in workers + new), "a pod registered twice"
        outs = [p for w in workers if (p := w.volume("/tmp") / "final.pt").exists()]
        assert len(outs) == 1
        got = torch.load(outs[0], weights_only=True)
        want = mesh_reference(total)
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
        assert cluster.stop(coordinator) == 0
