"""A cluster admin's checklist of the rendered manifests (coordinator/launchers/k8s.py):
one supported Kubernetes range, validated at both ends and stated once in the docs;
workload lifetimes, scratch limits and image digests in every format; the NetworkPolicies'
metrics_from; the coordinator's HTTPS scrape under TLS; the submitter's Role; the
workers' liveness endpoint and their named metrics ports. The wiring the rest of the
manifests keep: tests/test_k8s.py."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from coordinator.launchers.jobspec import FORMATS, JobSpecError, load_job_spec, parse_job_spec
from coordinator.launchers.k8s import KUBERNETES_VERSIONS, render, worker_objects
from tests.test_k8s import (
    BUILT_IN,
    DIGEST,
    EXAMPLE,
    GOOD,
    REPO,
    TOKEN,
    _component,
    by_key,
    pod_templates,
    spec_with,
    worker_container,
)


def test_the_supported_range_is_validated_at_both_ends_and_stated_once() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    low, high = KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]
    # the floor is real: the release before it has no podReplacementPolicy
    (job,) = worker_objects(load_job_spec(EXAMPLE))
    with pytest.raises(kubernetes_validate.ValidationError, match="podReplacementPolicy"):
        kubernetes_validate.validate(job, "1.27.0", strict=True)
    # the docs name this one range, and no other
    stated = f"Kubernetes {low}–{high}"
    pages = [REPO / "k8s" / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
    text = {p: p.read_text() for p in pages}
    assert any(stated in t for t in text.values())
    for page, t in text.items():
        for other in re.findall(r"Kubernetes (?:≥ ?|>= ?)?1\.\d+(?:[–-]1\.\d+)?", t):
            assert other == stated, f"{page.relative_to(REPO)} states {other!r}, not {stated!r}"


def test_lifetimes_scratch_limits_and_digests_reach_every_format() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    data = spec_with(
        ttl_after_finished_s=3600,
        deadline_s=7200,
        tmp_size="20Gi",
        shm_size="2Gi",
        image_digests={"cpu": DIGEST},
    )
    for fmt in FORMATS:
        spec = parse_job_spec({**data, "format": fmt})
        objs = by_key(render(spec, token=TOKEN))
        worker = worker_container(list(objs.values()))
        assert worker["image"] == f"zeroplane:0.1.0-cpu@{DIGEST}"
        coordinator = objs[("Deployment", "gpt-coordinator")]["spec"]["template"]["spec"]
        assert coordinator["containers"][0]["image"] == f"zeroplane:0.1.0-cpu@{DIGEST}"
        # the gpu variant has no digest given: its tag, as before
        gpu = worker_container(render(spec.for_device("cuda"), token=TOKEN))
        assert gpu["image"] == "zeroplane:0.1.0-cuda"
        (pod,) = [t for o in objs.values() for t in pod_templates(o) if _component(t) == "worker"]
        sizes = {v["name"]: v["emptyDir"] for v in pod["spec"]["volumes"] if "emptyDir" in v}
        assert sizes == {
            "tmp": {"sizeLimit": "20Gi"},
            "dshm": {"medium": "Memory", "sizeLimit": "2Gi"},
        }
        if fmt == "job":
            job = objs[("Job", "gpt-worker")]["spec"]
            assert (job["ttlSecondsAfterFinished"], job["activeDeadlineSeconds"]) == (3600, 7200)
            kubernetes_validate.validate(objs[("Job", "gpt-worker")], "1.29.0", strict=True)
        elif fmt == "pytorchjob":
            run = objs[("PyTorchJob", "gpt")]["spec"]["runPolicy"]
            assert run == {"activeDeadlineSeconds": 7200, "ttlSecondsAfterFinished": 3600}
        else:
            runtime = objs[("TrainingRuntime", "gpt")]["spec"]["template"]["spec"]
            assert runtime["ttlSecondsAfterFinished"] == 3600
            assert objs[("TrainJob", "gpt")]["spec"]["activeDeadlineSeconds"] == 7200
    # by default: a week, then cleaned up; no deadline; /dev/shm half the pod's memory
    job = worker_objects(parse_job_spec(GOOD))[0]["spec"]
    (shm,) = [v for v in job["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "2048Mi"  # resources.memory: 4Gi
    assert job["ttlSecondsAfterFinished"] == 7 * 24 * 3600
    assert "activeDeadlineSeconds" not in job
    kept = worker_objects(parse_job_spec({**GOOD, "ttl_after_finished_s": None}))[0]["spec"]
    assert "ttlSecondsAfterFinished" not in kept


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"shm_size": "4Gi"}, "shm_size"),  # the pod's whole memory limit
        ({"tmp_size": "lots"}, "tmp_size"),
        ({"deadline_s": 0}, "deadline_s"),
        ({"ttl_after_finished_s": -1}, "ttl_after_finished_s"),
        ({"image_digests": {"cpu": "sha256:abc"}}, "image_digests.cpu"),
        ({"image_digests": {"tpu": DIGEST}}, "image_digests.tpu"),
        ({"image": f"zeroplane:0.1.0-cpu@{DIGEST}", "image_digests": {"cpu": DIGEST}}, "image"),
        ({"metrics_from": "Monitoring"}, "metrics_from"),
    ],
)
def test_a_bad_checklist_field_is_named(change: dict[str, Any], field: str) -> None:
    with pytest.raises(JobSpecError, match=f"field '{re.escape(field)}'"):
        parse_job_spec(spec_with(**change))


def test_metrics_from_limits_who_reaches_the_metrics_ports() -> None:
    objs = by_key(render(parse_job_spec(spec_with(metrics_from="monitoring")), token=TOKEN))
    prometheus = {"kubernetes.io/metadata.name": "monitoring"}
    for name in ("gpt-coordinator", "gpt-worker"):
        (scrape,) = [r for r in objs[("NetworkPolicy", name)]["spec"]["ingress"] if "ports" in r][
            -1:
        ]
        assert scrape["from"] == [{"namespaceSelector": {"matchLabels": prometheus}}]


def test_a_tls_job_scrapes_its_coordinator_over_https_with_the_token() -> None:
    spec = parse_job_spec(spec_with(tls_secret="gpt-tls", monitoring="prometheus-operator"))
    objs = by_key(render(spec, token=TOKEN))
    workers, coordinator = objs[("PodMonitor", "gpt")], objs[("PodMonitor", "gpt-coordinator")]
    assert workers["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert "scheme" not in workers["spec"]["podMetricsEndpoints"][0]  # plain /metrics
    (endpoint,) = coordinator["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["authorization"]["credentials"] == {"name": "gpt-token", "key": "token"}
    assert endpoint["tlsConfig"]["serverName"] == "gpt-coordinator"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "gpt-tls", "key": "ca.crt"}


def test_the_submitter_role_covers_every_kind_a_job_renders() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from coordinator.launchers.k8s_files import submitter_role

    for fmt in FORMATS:
        spec = parse_job_spec(spec_with(format=fmt, monitoring="prometheus-operator"))
        role = submitter_role(spec)
        kubernetes_validate.validate(role, f"{KUBERNETES_VERSIONS[-1]}.0", strict=True)
        allowed = {
            (group, resource, verb)
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }
        for kind in OVERLAYS_KINDS:
            for obj in render(spec.for_device(kind), token=TOKEN):
                group = obj["apiVersion"].rpartition("/")[0]
                resource = obj["kind"].lower() + ("es" if obj["kind"].endswith("s") else "s")
                resource = resource.replace("policys", "policies")
                for verb in ("get", "create", "patch", "delete"):
                    assert (group, resource, verb) in allowed, (obj["kind"], verb)
        assert ("", "pods/log", "get") in allowed
        assert ("", "pods/portforward", "create") in allowed
        # nothing cluster-wide, nothing it does not render
        assert role["kind"] == "Role"
        assert ("", "nodes", "get") not in allowed


OVERLAYS_KINDS = ("cpu", "cuda")


def test_launcher_healthz_answers_while_its_loop_turns() -> None:
    import time
    import urllib.error
    import urllib.request

    from coordinator.launchers.health import serve_health
    from coordinator.launchers.local import find_free_port

    port = find_free_port("0.0.0.0")
    url = f"http://127.0.0.1:{port}/healthz"
    with serve_health(port, stale_s=0.5) as health:
        assert urllib.request.urlopen(url, timeout=5).status == 200
        time.sleep(0.6)  # the loop stopped turning
        with pytest.raises(urllib.error.HTTPError) as stale:
            urllib.request.urlopen(url, timeout=5)
        assert stale.value.code == 503
        health.beat()
        assert urllib.request.urlopen(url, timeout=5).status == 200
    with serve_health(None) as health:  # no port: nothing served
        health.beat()
    with pytest.raises(ValueError, match="health port"), serve_health("http"):
        pass


def test_a_pods_local_ranks_take_the_named_metrics_ports() -> None:
    from worker.metrics import env_metrics_port

    assert env_metrics_port("9400", 3) == 9400  # one port: every rank (a single process)
    assert env_metrics_port("0", 1) == 0
    assert [env_metrics_port("9400-9403", r) for r in range(4)] == [9400, 9401, 9402, 9403]
    assert env_metrics_port("9400-9401", 2) == 0  # a rank the launcher added: a free port
    for bad in ("http", "9401-9400", "0-3", "70000"):
        with pytest.raises(ValueError, match="ZEROPLANE_METRICS_PORT"):
            env_metrics_port(bad, 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tls_job_mounts_the_secret_and_passes_schema_validation(fmt: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    spec = dataclasses.replace(load_job_spec(EXAMPLE), format=fmt, tls_secret="gpt-tls")
    objects = render(spec, token=TOKEN)
    coordinator = by_key(objects)[("Deployment", "gpt-coordinator")]
    pod = coordinator["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    tls_args = ["--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
    # the status page, /sd and /metrics over HTTPS and behind the token
    assert container["args"][-6:] == [*tls_args, "--http-tls", "--http-auth"]
    # the kubelet's gRPC probe has no TLS: /healthz, the one path without a token
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    volume = {"name": "tls", "secret": {"secretName": "gpt-tls", "defaultMode": 0o440}}
    assert volume in pod["volumes"]
    (template,) = [
        t
        for o in objects
        for t in pod_templates(o)
        if t["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]
    env = {e["name"]: e.get("value") for e in worker_container(objects)["env"]}
    assert env["ZEROPLANE_TLS_ROOT_CERT"] == "/tls/ca.crt"
    (tls,) = [v for v in template["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the key
    for obj in objects:
        if obj["apiVersion"] in BUILT_IN:
            kubernetes_validate.validate(obj, "1.33.0", strict=True)
        for t in pod_templates(obj) if obj["apiVersion"] not in BUILT_IN else ():
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}}
            kubernetes_validate.validate({**wrapped, "template": t}, "1.33.0", strict=True)
