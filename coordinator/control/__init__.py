"""The control plane: membership, the gRPC server and its state file, the client the
workers and the CLI use, the status page and the coordinator's own metrics."""
