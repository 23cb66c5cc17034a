"""The mock NVML: fake GPUs that behave as NVML does, for CI and demo clusters.

Reached only through `driver.nvml.selection.select_backend(mock=True)`; the real NVML
path (`driver.nvml`) never imports it. `backend.MockBackend` is the plugin's backend
over it, which brings the mock's stand-ins along (its `control` actions,
`gpu-dra mock ...`; `timeslice`; `mps_control`). `nvml.MockNvml` is the
pynvml-compatible module; `fleet` reads the fleet files and the built-in model table
(`profiles/models.yaml`); `api`, `events`, `mig`, `mig_state`, `devices` and
`timeslice` model NVML's calls, events, MIG lifecycle, device nodes and
`nvidia-smi` time-slice settings.
"""
