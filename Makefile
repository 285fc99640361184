# Two commands matter: `make run` (serve the demo model locally) and `make test` (what CI runs).
# Both set everything up on first use: system packages (apt), the .venv, the project itself.
PYTHON ?= python3
# Where torch comes from when no wheel of it is on this machine already (scripts/install-torch.sh):
# PyTorch's CPU build by default; https://pypi.org/simple for PyPI's CUDA build; "" for pip's own choice.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup system-deps run test test-fast test-images lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@bash scripts/check-disk.sh
	@bash scripts/setup-system.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@TORCH_INDEX='$(TORCH_INDEX)' bash scripts/install-torch.sh $(PY)
	$(PY) -m pip install -q -e '.[engine,gateway,worker,dev]'
	@# the CPU executor's C++ extension, compiled now rather than silently at the first hybrid start
	$(PY) -m services.engine.moe.cpu_executor --build
	@rm -f $(VENV)/.installed-*; touch $@

system-deps:
	@bash scripts/setup-system.sh

# The compose topology as local processes (redis, worker, engine, gateway, Prometheus when installed).
# The demo runs the hybrid path with a quarter of the experts cached, so every request has misses split
# between the fetch and the CPU, and the dashboard's expert panels (miss rate, the split) have data.
# Other engine flags (later ones win): make run ARGS="--moe-backend offload --moe-cache-rate 0.5"
DEMO_ARGS ?= --moe-backend hybrid --moe-cache-rate 0.25
run: setup
	$(VENV)/bin/tandem stack --model $${TANDEM_MODEL:-demo} --device cpu --port $${PORT:-8000} $(DEMO_ARGS) $(ARGS)

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

# The images built and the compose stack run end to end (root, podman; CI runs it after `make test`).
# Not part of `make test`: tests/deploy/compose_e2e.py is outside pytest's test_*.py collection.
test-images: setup
	@bash scripts/setup-system.sh images
	$(PY) -m pytest -s tests/deploy/compose_e2e.py

clean:
	rm -rf $(VENV) .pytest_cache
