PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The versions the suite last passed with (pip constraints); `make upgrade-deps` moves them.
LOCK := requirements.lock

.PHONY: install test lint serve gsm8k upgrade-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade -c $(LOCK) pip
	$(VPY) -m pip install -q -c $(LOCK) torch
	$(VPY) -m pip install -q -c $(LOCK) -e '.[test,nixl]'
	$(VPY) -m baton.kernels.cpu.build  # the C kernels, built now rather than on the first request
	touch $(STAMP)

# The NIXL tests skip where NIXL cannot be imported; here it is installed, so they must run.
REQUIRE_NIXL := $(if $(filter Linux,$(shell uname -s)),1,0)

test: install
	BATON_REQUIRE_NIXL=$(REQUIRE_NIXL) $(VPY) -m pytest -q tests $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# make serve [MODEL=path/to/hf-model-dir] [SERVE_ARGS="--port 8001 ..."]: a prefill worker, a
# decode worker and a router on 127.0.0.1 (`baton up`), serving the model shipped in assets/
# unless MODEL says otherwise.
MODEL ?= assets
serve: install
	@test -f "$(MODEL)/config.json" || { echo "make serve: $(MODEL)/config.json not found (pass MODEL=path/to/hf-model-dir)"; exit 2; }
	$(VENV)/bin/baton up --model $(MODEL) $(SERVE_ARGS)

# make gsm8k [GSM8K_ARGS="--num-questions 50 --output results.json"]: serve the shipped assets/
# model on a free port, run `baton eval gsm8k` on the held-out file, print the accuracy, stop.
gsm8k: install
	$(VPY) -m baton.bench.accuracy.run_gsm8k $(GSM8K_ARGS)

# make upgrade-deps [PYTEST_ARGS=...]: every dependency at its newest release in a fresh venv
# (.venv-upgrade), the suite run there, and the lock rewritten from that venv only if it passes;
# then `make install` brings .venv to the new lock. Commit requirements.lock with what it needed.
UPGRADE := .venv-upgrade
upgrade-deps:
	rm -rf $(UPGRADE)
	$(PY) -m venv $(UPGRADE)
	$(UPGRADE)/bin/python -m pip install -q --upgrade pip
	$(UPGRADE)/bin/python -m pip install -q torch==2.13.0
	$(UPGRADE)/bin/python -m pip install -q --upgrade -e '.[test,nixl]'
	$(UPGRADE)/bin/python -m baton.kernels.cpu.build
	BATON_REQUIRE_NIXL=$(REQUIRE_NIXL) $(UPGRADE)/bin/python -m pytest -q tests $(PYTEST_ARGS)
	$(PY) tools/write_lock.py --venv $(UPGRADE) --output $(LOCK)
	rm -rf $(UPGRADE)
	$(MAKE) install

clean:
	rm -rf $(VENV) $(UPGRADE) build *.egg-info
