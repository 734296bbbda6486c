# On a fresh machine (Python 3.11 and make):
#   make run   - set up .venv and run the quick-start scenario (v2-8, CNN, digits)
#   make test  - set up .venv and run the test suite
#   make monitor - Prometheus on http://127.0.0.1:9090 scraping a run (needs the
#                  'prometheus' binary: sudo apt-get install prometheus); Ctrl-C stops it
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test monitor setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

run: setup
	$(BIN)/tpu-pod run scenarios/quickstart.yaml --output-dir runs/quickstart

test: setup
	$(BIN)/python -m pytest -q

monitor: setup
	$(BIN)/tpu-pod monitor

clean:
	rm -rf $(VENV) runs build dist *.egg-info
