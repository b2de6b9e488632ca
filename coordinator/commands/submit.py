"""``zeroplane submit``: render a job spec into Kubernetes manifests and apply them."""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from coordinator.core.settings import write_private
from coordinator.launchers.jobspec import FORMATS, JobSpec, JobSpecError, load_job_spec
from coordinator.launchers.k8s import COORDINATOR_PORT, find_dashboard, render
from coordinator.launchers.k8s_files import GENERATED, dump_yaml, kustomize_tree, overlay_for

__all__ = ["add_parser", "submit", "write_tree"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "submit",
        help="run a job spec on Kubernetes (renders and applies its manifests)",
        description=(
            "Render JOB.yaml (name, image, script and args, workers min/max, stage, device, "
            "resources, compression, format, monitoring) into a kustomize base with cpu and "
            "gpu overlays in --out, create the bearer token, and `kubectl apply -k` the "
            "overlay of the job's device kind."
        ),
    )
    parser.add_argument("job", type=Path, metavar="JOB.yaml", help="the job spec")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="how the workers run (default: the spec's format, else job): an Indexed Job, "
        "a Kubeflow Trainer v2 TrainJob, or a Kubeflow training-operator v1 PyTorchJob",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the manifests (with a fresh token, or --token-file's) and apply nothing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where the manifests are written (default ./zeroplane-<name>)",
    )
    parser.add_argument(
        "--no-apply",
        action="store_true",
        help="write the manifests (no token) and stop; k8s/ is made this way",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="the bearer token (default: DIR/base/token if it exists, else a new random one)",
    )
    parser.set_defaults(func=submit)
    return parser


def write_tree(spec: JobSpec, out: Path, *, dashboard: str | None) -> list[Path]:
    """Write the kustomize tree; generated files it no longer makes are removed."""
    files = kustomize_tree(spec, dashboard=dashboard)
    for sub in ("base", "overlays/cpu", "overlays/gpu", "rbac"):
        directory = out / sub
        if directory.is_dir():
            for old in directory.glob("*.yaml"):
                stale = str(old.relative_to(out)) not in files
                if stale and old.read_text().startswith(GENERATED):
                    old.unlink()
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


# the token a dry run's Secret shows in place of the real one
DRY_RUN_TOKEN = "placeholder-zeroplane-submit-writes-the-real-token"


def _token(args: argparse.Namespace, existing: Path | None) -> str:
    for path in (args.token_file, existing):
        if path is not None and path.is_file():
            try:
                token = path.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError:
                raise ValueError(f"token file {str(path)!r} is not UTF-8 text") from None
            if not token:
                raise ValueError(f"token file {str(path)!r} is empty")
            return token
    if args.token_file is not None:
        raise ValueError(f"token file {str(args.token_file)!r} does not exist")
    return secrets.token_hex(32)


def submit(args: argparse.Namespace) -> int:
    try:
        spec = load_job_spec(args.job)
    except JobSpecError as exc:
        print(f"zeroplane submit: {exc}", file=sys.stderr)
        return 2
    if args.format is not None:
        spec = dataclasses.replace(spec, format=args.format)
    if "@" not in spec.worker_image:
        print(
            f"zeroplane submit: warning: image {spec.worker_image} is pinned by tag only (a "
            f"registry can move a tag): give image_digests.{spec.device.kind} in the job spec",
            file=sys.stderr,
        )
    dashboard = find_dashboard()
    out = args.out or Path(f"zeroplane-{spec.name}")
    token_path = out / "base" / "token"
    try:
        token = None if args.no_apply else _token(args, None if args.dry_run else token_path)
    except ValueError as exc:
        print(f"zeroplane submit: {exc}", file=sys.stderr)
        return 2

    if args.dry_run:
        # what is printed is often pasted or logged: the Secret shows a placeholder
        shown = None if token is None else DRY_RUN_TOKEN
        print("# the token Secret holds a placeholder; a submit writes the real one")
        print(dump_yaml(render(spec, token=shown, dashboard=dashboard)), end="")
        return 0

    write_tree(spec, out, dashboard=dashboard)
    overlay = out / "overlays" / overlay_for(spec)
    apply = f"kubectl apply -k {overlay}"
    if args.no_apply:
        print(f"zeroplane submit: wrote {out}/ (kustomize base, overlays cpu and gpu)")
        if not token_path.exists():
            print(f"  before applying: openssl rand -hex 32 > {token_path}")
        print(f"  apply: {apply}")
        return 0

    assert token is not None
    write_private(token_path, (token + "\n").encode())
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print(
            f"zeroplane submit: kubectl is not on PATH, so nothing was applied; the manifests "
            f"are in {out}/: apply them with `{apply}`",
            file=sys.stderr,
        )
        return 1
    print(f"zeroplane submit: {apply}", flush=True)
    code = subprocess.run([kubectl, "apply", "-k", str(overlay)], check=False).returncode
    if code != 0:
        print(f"zeroplane submit: kubectl apply failed with exit code {code}", file=sys.stderr)
        return code
    print(f"submitted job {spec.name!r}")
    for what, command in _next_steps(spec, overlay, token_path):
        print(f"  {what + ':':7} {command}")
    return 0


# The condition `kubectl wait` waits for on the workload once the job has finished.
_COMPLETE = {"job": "complete", "trainjob": "Complete", "pytorchjob": "Succeeded"}


def _whole_groups(spec: JobSpec) -> str:
    """What a scale of a mesh job must keep: whole model-parallel groups of processes."""
    group = spec.tensor_parallel * spec.pipeline_parallel
    if group == 1:
        return ""
    return f", N x {spec.device.count} process(es) a multiple of tp*pp = {group}"


def _next_steps(spec: JobSpec, overlay: Path, token_path: Path) -> list[tuple[str, str]]:
    kubectl = f"kubectl -n {spec.namespace}" if spec.namespace else "kubectl"
    workload = {
        "job": f"job/{spec.worker}",
        "trainjob": f"trainjob/{spec.name}",
        "pytorchjob": f"pytorchjob/{spec.name}",
    }[spec.format]
    complete = _COMPLETE[spec.format]
    steps = [("wait", f"{kubectl} wait --for=condition={complete} {workload} --timeout=-1s")]
    if spec.format == "job":
        scale = '{"spec":{"completions":N,"parallelism":N}}'
        steps.append(
            (
                "scale",
                f"{kubectl} patch {workload} --type=merge -p '{scale}' "
                f"(N in [{spec.workers.min}, {spec.workers.max}]{_whole_groups(spec)})",
            )
        )
    workers = f"app.kubernetes.io/instance={spec.name},app.kubernetes.io/component=worker"
    forward = f"{kubectl} port-forward svc/{spec.coordinator} {COORDINATOR_PORT}"
    steps += [
        ("status", f"{forward} & ZEROPLANE_TOKEN_FILE={token_path} zeroplane status"),
        ("logs", f"{kubectl} logs -f -l {workers} --prefix"),
        ("delete", f"kubectl delete -k {overlay}"),
    ]
    return steps
