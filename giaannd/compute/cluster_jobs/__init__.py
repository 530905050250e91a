"""Cluster jobs: one training job over every compute node, windows handed out as leases
over replicated registers (docs/compute.md, "Cluster jobs"). Sans-IO protocol plus its driver."""
