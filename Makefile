PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint serve gsm8k clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m kernels.build  # the C kernels, built now rather than on the first request
	touch $(STAMP)

test: install
	$(VPY) -m pytest -q tests $(PYTEST_ARGS)

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
	$(VPY) -m bench.run_gsm8k $(GSM8K_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
