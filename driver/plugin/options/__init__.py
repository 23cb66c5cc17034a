"""The kubelet plugin's settings: flags and environment variables, their values, the
per-node overrides from Node labels, and the host paths they name (README's flag
table)."""
