"""The mock NVML's MIG lifecycle: NVML's MIG calls and errors, their records and state
under the mock driver root, and its /proc/devices (docs/mock-fleet.md)."""
