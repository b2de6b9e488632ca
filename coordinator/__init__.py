"""zeroplane's control plane and tools; nothing in this package imports torch.

Subpackages by role, each importing only those above it in this list:

- ``coordinator.core``: the torch-free core shared with the workers: the shard layout
  and element ranges, reshard schedules, memory formulas, the planner, the mesh's
  shape, the control-plane messages, the checkpoint manifest, settings and
  environment names. ``worker`` imports nothing of ``coordinator`` but this and the
  gRPC client (``coordinator.control.client``); tests/test_engine_structure.py checks it.
- ``coordinator.control``: the coordinator itself: membership (a pure state machine),
  the gRPC server, its state file, the client, the status page and its metrics.
- ``coordinator.launchers``: starting jobs: local processes and the fork server, Ray,
  Kubernetes and the job spec, the progress display and the job summary.
- ``coordinator.tuning``: running jobs to choose settings: the autotuner, its trial
  pool and the hyperparameter search.
- ``coordinator.commands``: the CLI's subcommands (``coordinator.cli`` is the entry).
"""
