# gpu-dra-driver — every set-up step a fresh machine needs lives here.
PYTHON_BOOTSTRAP ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv lock proto proto-check lint typecheck unit integration e2e test test-gpu test-reliability \
        cluster-build cluster-up cluster-down cluster-status demo bench bench-scale clean helm image \
        kind-up kind-install kind-demo kind-down nvidia-tools kubelet-kep5322 e2e-kep5322

venv: $(VENV)/.installed

# Every download is checked against requirements.lock's sha256 hashes (--require-hashes):
# first pip itself (its block of the lock), then everything else. The project's own
# editable install cannot carry a hash; it is a separate step, --no-deps, built with the
# setuptools just installed from the lock (--no-build-isolation: nothing unhashed is
# fetched for it). hack/pip_progress.py prints each step's progress as counts against
# the lock (a cold install, 56 packages, took about 1.5 minutes on the 2-core machine).
PIP_PROGRESS := $(PYTHON_BOOTSTRAP) hack/pip_progress.py
$(VENV)/.installed: pyproject.toml requirements.lock
	@echo "[venv 1/4] creating $(VENV) with $(PYTHON_BOOTSTRAP)"
	$(PYTHON_BOOTSTRAP) -m venv $(VENV)
	awk '/^[^ #]/ { keep = /^pip==/ } keep' requirements.lock >$(VENV)/pip.lock
	$(PIP_PROGRESS) --step 2/4 --lock $(VENV)/pip.lock -- \
	  $(PY) -m pip install --progress-bar off --require-hashes --no-deps -r $(VENV)/pip.lock
	$(PIP_PROGRESS) --step 3/4 --lock requirements.lock -- \
	  $(PY) -m pip install --progress-bar off --require-hashes -r requirements.lock
	$(PIP_PROGRESS) --step 4/4 -- \
	  $(PY) -m pip install --progress-bar off --no-deps --no-build-isolation -e .
	touch $@

# Regenerates requirements.lock with the hashes of every file of every pinned version
# (pip-tools in a throwaway venv; today's versions kept). hack/lock.sh --upgrade moves them.
lock:
	hack/lock.sh

proto: venv
	PYTHON=$(abspath $(PY)) hack/gen-proto.sh

proto-check: venv
	PYTHON=$(abspath $(PY)) hack/gen-proto.sh --check

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

# Helm is built from the Go module proxy into the cache (pinned in hack/versions.env).
helm:
	hack/install-helm.sh

# NVIDIA's nvidia-ctk and nvidia-cdi-hook (NVIDIA_CTK_VERSION in hack/versions.env) and
# cmd/gpu-dra-cdi-common, built into the cache; hack/build-nvidia-tools.sh.
nvidia-tools:
	hack/build-nvidia-tools.sh

unit: venv helm nvidia-tools
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

# Control plane and the real node (kubelet, containerd, runc, Debian packages).
cluster-build:
	GPU_DRA_WITH_NODE=1 hack/local-cluster.sh build

cluster-up: cluster-build
	hack/local-cluster.sh up

cluster-down:
	hack/local-cluster.sh down

cluster-status:
	hack/local-cluster.sh status

# The integration tier starts (and stops) its own control plane from the cached
# binaries; cluster-build builds them first on a machine where they are missing.
integration: venv cluster-build helm nvidia-tools
	$(VENV)/bin/pytest tests/integration $(PYTEST_ARGS)

# The e2e tier starts its own cluster with the real node (or uses GPU_DRA_KUBECONFIG)
# and installs the chart; the driver image is built by `up` when the sources changed.
e2e: venv cluster-build nvidia-tools
	$(VENV)/bin/pytest tests/e2e $(PYTEST_ARGS)

# KEP-5322 (docs/kep-5322.md): build the prototype kubelet (hack/patches/) and run the
# e2e checks on it with DRAHandlePermanentDriverFailures on, then with it off.
kubelet-kep5322: venv
	hack/build-kubelet-kep5322.sh

e2e-kep5322: venv cluster-build nvidia-tools kubelet-kep5322
	GPU_DRA_KEP5322_KUBELET=1 $(VENV)/bin/pytest tests/e2e/test_kep5322.py $(PYTEST_ARGS)
	GPU_DRA_KEP5322_KUBELET=1 GPU_DRA_KEP5322_GATE=false \
		$(VENV)/bin/pytest tests/e2e/test_kep5322.py tests/e2e/test_failures.py $(PYTEST_ARGS)

# One command on a fresh machine: build what is missing, start the cluster with its
# node, install the driver, run every demo/ example and the failure scenarios.
demo: venv
	demo/demo.sh

# Everything CI runs: static checks, generated code up to date, every test tier.
test: venv proto-check lint typecheck cluster-build helm nvidia-tools
	$(VENV)/bin/pytest tests --ignore=tests/gpu $(PYTEST_ARGS)

# The real-GPU tier: discovery, events, prepare and the MIG lifecycle against the
# host's libnvidia-ml. Skips with one line where there is no GPU; never changes a
# GPU's MIG mode. docs/gpu-testing.md.
test-gpu: venv
	$(VENV)/bin/pytest tests/gpu $(PYTEST_ARGS)

# The driver image as an OCI archive, without Docker (needs root); see hack/build-image.sh.
image:
	hack/build-image.sh

# The path for users with Docker: a kind cluster with the same gates and chart values.
kind-up:
	hack/kind/create-cluster.sh
kind-install:
	hack/kind/build-and-load-image.sh && hack/kind/install.sh
kind-demo:
	hack/kind/demo.sh
kind-down:
	hack/kind/delete-cluster.sh

# The reliability suite alone (make test runs it too): fault injection against the
# local control plane; prints its figures at the end.
test-reliability: venv cluster-build
	$(VENV)/bin/pytest tests/reliability $(PYTEST_ARGS)

# Benchmarks (docs/benchmarks.md), this driver and the Go reference taking turns. The
# reference is built by hack/build-reference.sh (pinned in hack/versions.env, cached)
# unless GPU_DRA_REFERENCE_PLUGIN names a binary; BENCH_ARGS e.g. --scenario prepare.
bench: venv cluster-build
	@ref="$${GPU_DRA_REFERENCE_PLUGIN:-$$(hack/build-reference.sh | tail -n 1)}" && \
	$(PY) -m bench.run --reference "$$ref" --plot docs/prepare-latency.png $(BENCH_ARGS)

# The real kube-scheduler against 10, 100 and 500 fake nodes of this driver's slices
# (every MIG placement, whole GPUs, --gpu-partitions 4); bench/results/scale-<date>.json.
# SCALE_ARGS e.g. --nodes 10 --repetitions 1.
bench-scale: venv cluster-build
	$(PY) -m bench.scale $(SCALE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
