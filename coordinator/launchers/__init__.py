"""Starting a job's workers: local processes (and the fork server), Ray, Kubernetes (with
the job spec both use), and what a launcher shows while the job runs."""
