# The two commands of the README. Both create .venv on first use (Python 3.12, from .python-version).
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3)
VENV := .venv
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: demo test clean-demo

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else "m3jax needs Python 3.12; found " + sys.version.split()[0] + " at " + sys.executable)'
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/m3-train --config configs/demo.yaml --run-dir runs/demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

clean-demo:
	rm -rf runs/demo
