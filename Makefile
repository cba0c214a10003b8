# vlmrun: `make demo` (install + the embedded default run) and `make test` (install + lint + the test suite).
PYTHON ?= python3
VENV   := .venv
PIP    := $(VENV)/bin/pip
# torch 2.14.1 with torchvision 0.29.1 is the pair whose standard HF processor path works
# (docs/measurements.md); pin both on the same command line so no dependency pulls another torch.
TORCH  := torch==2.14.1 torchvision==0.29.1
export HF_HUB_OFFLINE := 1
export WANDB_MODE ?= offline

.PHONY: setup system-libs demo lint test test-fast test-e2e test-tools test-vllm clean vllm-cpu vllm-gpu

setup: system-libs $(VENV)/.installed

# Mooncake (the data plane's `backend: mooncake`) links Debian's libibverbs1 even for TCP. Installed with
# apt-get when missing and we are root; otherwise said, and the Mooncake tests skip with that reason.
system-libs:
	@$(PYTHON) -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make setup: installing libibverbs1 (Mooncake links it)"; \
	  apt-get install -y -qq libibverbs1 >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libibverbs1 >/dev/null 2>&1; } || \
	  echo "make setup: apt-get could not install libibverbs1; the Mooncake tests will skip"; \
	else \
	  echo "make setup: libibverbs.so.1 is missing (Debian: sudo apt-get install libibverbs1); the Mooncake tests will skip"; \
	fi

# uv (pinned, installed into the venv first) does the install: the same versions as pip (the same pins
# and constraints; the venv keeps pip), in ~25 s on a fresh machine where pip took ~100 s (downloading
# and unpacking torch's 5.5 GB one file at a time; docs/measurements.md). uv reads no pip.conf: where
# packages come from a private index that only pip's configuration names, uv fails and pip installs.
# --compile-bytecode, as pip does: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE=1 (CI's
# machines) no process ever writes one, so every Ray worker and rank compiled torch and transformers from
# source at each import: the suite took 45 min there and TransferQueue's actors missed their 60 s start.
# The project itself is installed editable, which uv leaves uncompiled: compileall writes its bytecode.
UV     := $(VENV)/bin/uv
INSTALL_ARGS := -c requirements/tested.txt $(TORCH) -e '.[test]'
$(VENV)/.installed: pyproject.toml requirements/tested.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c requirements/tested.txt uv
	$(UV) pip install -q --compile-bytecode --python $(VENV)/bin/python $(INSTALL_ARGS) || \
	  { echo "make setup: uv could not install (above); installing with pip"; \
	    $(PIP) install -q --disable-pip-version-check $(INSTALL_ARGS); }
	$(VENV)/bin/python -m compileall -q -j 0 vlmrun tools >/dev/null  # the editable project's bytecode too
	touch $@

demo: setup
	$(VENV)/bin/vlmrun submit recipes/tiny-clevr-cpu.yaml --cluster local --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S) --wait

# The project's habits, cheapest first, so a slip fails in seconds rather than after the suite:
# lint rules, formatting, the layer contracts (pyproject.toml, docs/architecture.md).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# Three pytest workers on the 2 CPUs: a real run leaves part of a CPU idle (start-up waits, SLURM's queue);
# measured on a fresh clone, the suite took 16.1 min with two workers and 14.4 with three (CPU 85-99% busy).
# Each module runs whole on one worker, the SLURM ones together, the heaviest units first (tests/conftest.py says why).
# pytest exits 5 when it collected no tests: that is a failure here, said in words.
PYTEST := $(VENV)/bin/python -m pytest -n 3 --dist loadscope --no-loadscope-reorder
# The suite's lanes (tests/conftest.py): unit (logic, in-process), e2e (real runs, spawned ranks: `slow`; the
# local SLURM cluster: `slurm`), tools (the smoke runs of tools/). `make test` runs them all in one session.
LANE_unit  := -m "not slow and not slurm and not tools"
LANE_e2e   := -m "(slow or slurm) and not tools"
LANE_tools := -m "tools"
define run_pytest
	@$(PYTEST) -q -ra $(1); rc=$$?; \
	if [ $$rc = 5 ]; then echo "make: pytest collected no tests"; fi; exit $$rc
endef

# The vllm engine's own environment (generation.backend: vllm; docs/architecture.md): vLLM's line and the torch it
# pins, never the project's venv (torch 2.14.1 there). Built from the venv's own interpreter (Ray refuses another
# Python) by tools/vllm_env/build.sh, which prints its install time; a second call does nothing while the
# requirements are unchanged. vllm-cpu: on any machine (CI runs the real engine there); vllm-gpu: on a GPU node.
VLLM_CPU := .vllm-cpu
VLLM_GPU := .vllm
VLLM_ENV_INPUTS := requirements/vllm-overrides.txt tools/vllm_env/build.sh
$(VLLM_CPU)/vlmrun-engine.json: requirements/vllm-cpu.txt tools/vllm_env/torchvision_cpu_shim.py $(VLLM_ENV_INPUTS) | $(VENV)/.installed
	VENV=$(VENV) bash tools/vllm_env/build.sh $(VLLM_CPU) cpu
$(VLLM_GPU)/vlmrun-engine.json: requirements/vllm-gpu.txt $(VLLM_ENV_INPUTS) | $(VENV)/.installed
	VENV=$(VENV) bash tools/vllm_env/build.sh $(VLLM_GPU) gpu

vllm-cpu: $(VLLM_CPU)/vlmrun-engine.json
	@echo "make vllm-cpu: $(VLLM_CPU) is ready: $$(cat $<)"

vllm-gpu: $(VLLM_GPU)/vlmrun-engine.json
	@echo "make vllm-gpu: $(VLLM_GPU) is ready: $$(cat $<)"

# The vllm lane's tests (marked `vllm`) run in `make test` and `make test-e2e` when the engine's environment is
# built (make vllm-cpu; .ci/run builds it), and skip naming it otherwise (fail, where CI is set).
test: lint
	$(call run_pytest,--durations=15)

test-fast: lint
	$(call run_pytest,$(LANE_unit))

test-e2e: lint
	$(call run_pytest,$(LANE_e2e))

# The vllm lane alone: the real engine in process and tiny GRPO runs through the CLI.
test-vllm: lint vllm-cpu
	$(call run_pytest,-m vllm)

test-tools: lint
	$(call run_pytest,$(LANE_tools))

clean:
	rm -rf $(VENV) $(VLLM_CPU) $(VLLM_GPU) runs data .pytest_cache
