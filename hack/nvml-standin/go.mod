module github.com/gpu-dra-driver/nvml-standin

go 1.26.0
