PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint serve clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(VPY) -m pytest -q tests $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# make serve MODEL=path/to/hf-model-dir [SERVE_ARGS="--port 8001 ..."]
MODEL ?=
serve: install
	@test -n "$(MODEL)" || { echo "make serve needs MODEL=path/to/model-dir (no model ships in assets/ yet)"; exit 2; }
	$(VENV)/bin/baton serve --model $(MODEL) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
