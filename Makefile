# fleetpilot developer entry points. Every target sets itself up: a fresh clone needs only
# python3 (3.11+) on PATH. Go is needed for the control-plane tests (e2e/controlplane).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SRC := fleetpilot

CLUSTER_DIR := .cache/cluster

.PHONY: setup vllm baselines test lint typecheck imports unit controlplane kstatus processnode gateway gie-epp gatewaycrds prometheus actionlint shellcheck locks chart-readme cluster-up cluster-down cluster-demo demo crds clean bench bench-quick

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[engine,s3,dev]'
	@touch $(STAMP)

setup: $(STAMP)

# The real vLLM, the judge of the contract tests (tests/contract): the pyproject's `vllm` extra,
# pinned to the engine image's release, in a virtualenv of its own (it pins a torch other than
# the engine extra's). It cannot serve here; the tests use its parser, metric names and types.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQUIREMENT = $(shell $(PYTHON) -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm'][0])")

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@echo "installing $(VLLM_REQUIREMENT) into $(VLLM_VENV) (first time: several minutes, ~10 GB)"
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check '$(VLLM_REQUIREMENT)'
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Established routers the benchmarks measure ours against (bench/router_kv_events.py): the
# pyproject's `baselines` extra in a virtualenv of its own. Not needed by the tests.
BASELINES_VENV := .venv-baselines
BASELINES_STAMP := $(BASELINES_VENV)/.installed
BASELINES_REQUIREMENT = $(shell $(PYTHON) -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['baselines'][0])")

$(BASELINES_STAMP): pyproject.toml
	@test -x $(BASELINES_VENV)/bin/python || $(PYTHON) -m venv $(BASELINES_VENV)
	$(BASELINES_VENV)/bin/python -m pip install --quiet --disable-pip-version-check '$(BASELINES_REQUIREMENT)'
	@touch $(BASELINES_STAMP)

baselines: $(BASELINES_STAMP)

lint: setup
	$(BIN)/ruff check $(SRC) tests e2e bench
	$(BIN)/ruff format --check $(SRC) tests e2e bench

typecheck: setup
	$(BIN)/mypy $(SRC) bench

imports: setup
	$(BIN)/lint-imports

# kube-apiserver, controller-manager, scheduler and etcd built from Go modules (Go on PATH;
# the first build takes ~7 minutes on 2 cores, later ones are skipped or relink in seconds).
controlplane:
	e2e/controlplane/build.sh

# A real Prometheus server for the autoscaler tests: Debian's package, installed when missing
# (CI and developer machines run as root; elsewhere install it yourself).
# Flux's kstatus (sigs.k8s.io/cli-utils, pinned in e2e/kstatus/go.mod) as a small checker the
# e2e tests pipe live objects through (the first build takes ~2 minutes).
kstatus:
	e2e/kstatus/build.sh

# The process node (e2e/processnode): a virtual-kubelet provider that runs the test cluster's
# pods as local processes, each pod in its own network namespace (the tests run it as root).
# Its Go tests cover the pure parts (env and $(VAR) expansion, image table, volume files);
# e2e/test_process_node.py the rest, on the real control plane.
processnode:
	e2e/processnode/build.sh
	cd e2e/processnode && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly go test ./...

# The test gateway (e2e/gateway): Envoy's side of the external-processing protocol for an
# InferencePool, in front of an endpoint picker (there is no Envoy binary here).
gateway:
	e2e/gateway/build.sh

# The Gateway API Inference Extension's own endpoint picker, its full EPP at v1.3.0 (pinned as
# a tool in e2e/gie-epp/go.mod), built from the module (~2-3 minutes on 2 cores the first
# time): the e2e tests run it behind the test gateway, the benchmarks against fleetpilot's.
gie-epp:
	e2e/gie-epp/build.sh

# The Gateway API's and its Inference Extension's CRDs (InferencePool v1, HTTPRoute), copied
# from the Go modules pinned in e2e/gatewaycrds/go.mod into .cache/gatewaycrds for the tests.
gatewaycrds:
	e2e/gatewaycrds/build.sh

# rhysd/actionlint (pinned as a tool in e2e/actionlint/go.mod), built from its Go module like
# the tools above (~1 minute the first time): tests/test_release.py checks .github/workflows
# with it, the release workflow included, which cannot run here.
actionlint:
	e2e/actionlint/build.sh

# ShellCheck, which actionlint runs on every `run:` script: Debian's package, installed when
# missing (as root, like prometheus below).
shellcheck:
	@command -v shellcheck >/dev/null || { \
		echo "installing Debian's shellcheck package for the workflow lint"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null; }
	@shellcheck --version | sed -n 2p

# The images' hashed lock files (engine_image/requirements/*.txt, what the Dockerfiles install
# with --require-hashes), resolved by uv (the dev extra) for the images' Python 3.11 on
# linux/amd64 glibc, wheels only (the slim images have no compiler). Rerun after changing
# pyproject.toml's dependencies (tests/test_locks.py fails until then); existing pins are kept
# where they still fit, `make locks UPGRADE=--upgrade` moves them all to the newest.
# reference.txt leaves out torch (the image takes the CPU build of the engine extra's pin from
# PyTorch's index) and, through torch-cuda.txt, the CUDA stack PyPI's Linux torch requires.
# vllm.txt is for the vllm/vllm-openai base, which brings its own Python and packages:
# vllm-image.txt is what that image holds (the vllm extra's release and the additions
# vllm-image.in lists, resolved alone, unhashed: nothing installs from it); vllm.txt resolves
# the base dependencies together with it, held to its versions (-c), and emits only the
# packages it lacks, so installing the lock adds to vLLM's environment and replaces nothing.
LOCKS := engine_image/requirements
UV_PIP_COMPILE = $(BIN)/uv pip compile --quiet --system-certs --only-binary :all: \
	--custom-compile-command 'make locks' $(UPGRADE)
UV_COMPILE = $(UV_PIP_COMPILE) --generate-hashes \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28
# vLLM's docker/Dockerfile builds its image on Python 3.12 (PYTHON_VERSION) over Ubuntu 22.04
# (glibc 2.35); Dockerfile.vllm fails on another Python.
VLLM_TARGET = --python-version 3.12 --python-platform x86_64-manylinux_2_35

locks: setup
	$(BIN)/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')" \
		| $(UV_COMPILE) - -o $(LOCKS)/build.txt
	$(UV_COMPILE) pyproject.toml --extra s3 -o $(LOCKS)/operator.txt
	$(UV_COMPILE) pyproject.toml --extra engine --no-emit-package torch \
		--excludes $(LOCKS)/torch-cuda.txt -o $(LOCKS)/reference.txt
	{ echo '$(VLLM_REQUIREMENT)'; cat $(LOCKS)/vllm-image.in; } \
		| $(UV_PIP_COMPILE) $(VLLM_TARGET) --no-annotate - -o $(LOCKS)/vllm-image.txt
	$(UV_PIP_COMPILE) $(VLLM_TARGET) --generate-hashes pyproject.toml --extra vllm \
		$(LOCKS)/vllm-image.in -c $(LOCKS)/vllm-image.txt \
		$$(sed -n 's/^\([A-Za-z0-9._-]*\)==.*/--no-emit-package \1/p' $(LOCKS)/vllm-image.txt) \
		-o $(LOCKS)/vllm.txt

prometheus:
	@command -v prometheus >/dev/null || { \
		echo "installing Debian's prometheus package for the autoscaler tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
	@prometheus --version 2>&1 | head -1

# --durations lists the slowest tests at the end, so the suite's time (goal: well under 20
# minutes on CI's two cores) can be watched, and its cost found, from any CI log.
unit: setup vllm baselines controlplane kstatus processnode gateway gie-epp gatewaycrds prometheus actionlint shellcheck
	$(BIN)/pytest --durations=30

cluster-up: setup controlplane
	@$(BIN)/python -m fleetpilot.testing.cli up --dir $(CLUSTER_DIR)

cluster-down: setup
	@$(BIN)/python -m fleetpilot.testing.cli down --dir $(CLUSTER_DIR)

# The whole loop on Kubernetes on this machine: the control plane, two process nodes (root, Go),
# the chart's operator, examples/cpu-two-tier.yaml applied and waited for with kubectl (on
# PATH), chats through the router pod showing tiers and prefix hits, a scale-up served by the
# new pod, then teardown with nothing left running (fleetpilot/testing/cluster_demo.py).
cluster-demo: setup
	@$(BIN)/python -m fleetpilot.testing.cluster_demo

test: lint typecheck imports unit

# charts/fleetpilot/README.md from values.yaml's `# --` comments (a test fails when stale).
chart-readme: setup
	$(BIN)/python charts/values_doc.py

crds: setup
	$(BIN)/fleetpilot crds

# The local fleet on this machine: a two-tier service on reference engines behind the router,
# a few requests showing tier choice and prefix-cache hits, then everything stopped.
demo: setup
	@echo "== fleetpilot plan -f examples/two-tier.yaml -o summary   (what a GPU cluster gets)"
	@$(BIN)/fleetpilot plan -f examples/two-tier.yaml -o summary
	@echo
	@$(BIN)/python -m fleetpilot.runtime.demo examples/local-two-tier.yaml

# Every benchmark behind a docs table rerun, then the tables re-rendered (bench/run_all.py;
# docs/development.md). It takes the machine's whole CPU: run it on a quiet one.
bench: setup
	$(BIN)/python bench/run_all.py

bench-quick: setup
	$(BIN)/python bench/run_all.py --quick

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
