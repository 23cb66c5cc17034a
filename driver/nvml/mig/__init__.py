"""MIG devices through NVML: the manager, its errors, listings, and capability nodes
(docs/mig.md)."""
