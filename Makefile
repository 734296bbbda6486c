# On a fresh machine (Python 3.11 and make):
#   make run    - set up .venv and run the quick-start scenario (v2-8, CNN, digits)
#   make test   - set up .venv and run the fast test tier (in-process, on every core with
#                 pytest-xdist; under 3 minutes on an idle 2-core machine)
#   make test-slow - the slow tier: Ray transport and faults, chaos, load, install, multi-node
#   make check  - types (mypy) and lint (ruff)
#   make docs   - the documentation site (MkDocs, Material theme) into site/; warnings fail
#   make lock   - refresh requirements-dev.lock from pyproject.toml's ranges
#   make monitor - Prometheus on http://127.0.0.1:9090 scraping a run (needs the
#                  'prometheus' binary: sudo apt-get install prometheus); Ctrl-C stops it
#   make oracle  - XLA's memory verdict for tools/xla_oracle/configs.yaml: compiles each
#                  config not yet in tools/xla_oracle/results/ for its TPU slice, no TPU needed
#                  (.venv-oracle with the 'tpu-compile' extra: jax[tpu], i.e. Google's libtpu);
#                  ONLY=<id>[,<id>] for some, FORCE=1 to compile again, JOBS=2 for two
#                  compiles at once (docs/xla-oracle.md)
#   make maxtext-step ONLY=T2 - MaxText 0.2.5's own train step for an oracle row, compiled
#                  the same way (.venv-maxtext, Python 3.12; tools/xla_oracle/hlo-maxtext/)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# the fast tier: everything but the tests marked slow (see pyproject.toml's markers)
FAST   := not slow and not chaos and not load and not install

.PHONY: run test test-slow check docs lock monitor setup clean oracle maxtext-venv maxtext-step

setup: $(VENV)/.installed

# The development environment is the versions CI tested (requirements-dev.lock); the
# package's own dependencies stay ranges (pyproject.toml).
$(VENV)/.installed: pyproject.toml requirements-dev.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

run: setup
	$(BIN)/tpu-pod run scenarios/quickstart.yaml --output-dir runs/quickstart

# -n auto: one pytest-xdist worker per core (the fast tier is in-process; the slow tier
# shares one Ray cluster per session and stays in one process)
test: setup
	$(BIN)/python -m pytest -q -n auto --durations=15 -m "$(FAST)"

test-slow: setup
	$(BIN)/python -m pytest -q --durations=15 -m "not ($(FAST))"

check: setup
	$(BIN)/python -m mypy
	$(BIN)/python -m ruff check pod chip interconnect

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet
	@echo "the site is in site/ (open site/index.html)"

lock: setup
	$(BIN)/python -m pip install --quiet pip-tools
	$(BIN)/pip-compile --quiet --strip-extras --no-emit-index-url --no-emit-find-links \
		--extra test --extra dev --extra docs -o requirements-dev.lock pyproject.toml
	# the package itself (a self-reference of its extras, at this checkout's path) is
	# installed editable by setup, never from the lock
	sed -i '/^tpu-pod-emulator @ file:/,+1d' requirements-dev.lock

monitor: setup
	$(BIN)/tpu-pod monitor

# The oracle's own environment: the package (the lock's versions) and the tpu-compile extra.
ORACLE_VENV := .venv-oracle
$(ORACLE_VENV)/.installed: pyproject.toml requirements-dev.lock
	$(PYTHON) -m venv $(ORACLE_VENV)
	$(ORACLE_VENV)/bin/python -m pip install --quiet --upgrade pip
	@$(ORACLE_VENV)/bin/python -m pip install --quiet -c requirements-dev.lock -e ".[tpu-compile]" \
		|| { echo "make oracle: could not install the 'tpu-compile' extra (jax[tpu] with Google's libtpu,"; \
		     echo "  Linux x86-64 / aarch64 wheels from the package index); the oracle needs libtpu to compile"; \
		     echo "  for TPUs and cannot run without it"; exit 1; }
	touch $@

oracle: $(ORACLE_VENV)/.installed
	$(ORACLE_VENV)/bin/python -m tools.xla_oracle $(if $(ONLY),--only $(ONLY)) $(if $(FORCE),--force) $(if $(JOBS),--jobs $(JOBS))

# MaxText's own step (tools/xla_oracle/maxtext_step.py): maxtext 0.2.5 needs Python >= 3.12.
# Its package lists every extra's dependency; this installs it without them and only what
# train_compile imports (jax[tpu] 0.12.0.1 brings libtpu 0.0.50.1, Google's, its own terms).
MAXTEXT_VENV := .venv-maxtext
MAXTEXT_PYTHON ?= $(or $(shell p=$$(pyenv prefix $$(pyenv latest 3.12 2>/dev/null) 2>/dev/null) && echo $$p/bin/python),python3.12)
$(MAXTEXT_VENV)/.installed:
	@command -v $(MAXTEXT_PYTHON) >/dev/null 2>&1 || { echo "make maxtext-venv: no" \
	  "$(MAXTEXT_PYTHON); maxtext 0.2.5 needs Python >= 3.12: pyenv install 3.12, or" \
	  "MAXTEXT_PYTHON=/path/to/python3.12"; exit 1; }
	$(MAXTEXT_PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet "jax[tpu]==0.12.0.1" flax==0.12.12 \
		optax==0.2.8 omegaconf==2.4.0 pydantic==2.14.4 absl-py==2.5.1 jaxtyping==0.3.11 \
		packaging pathwaysutils==0.1.13 jinja2 qwix==0.1.8 aqtp==0.9.0 tokamax==0.0.17 \
		huggingface_hub==2.4.0 transformers==5.24.0 grain==0.2.18 drjax==0.2.1 pillow \
		tiktoken==0.14.0 sentencepiece==0.2.3 sympy PyYAML
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet --no-deps maxtext==0.2.5
	touch $@

maxtext-venv: $(MAXTEXT_VENV)/.installed

# the rows are checked (one line for an unknown one) before the environment is built
maxtext-step: setup
	@$(BIN)/python -m tools.xla_oracle.maxtext_step --only $(or $(ONLY),T2) --args >/dev/null
	@$(MAKE) --no-print-directory $(MAXTEXT_VENV)/.installed
	$(BIN)/python -m tools.xla_oracle.maxtext_step --only $(or $(ONLY),T2)

clean:
	rm -rf $(VENV) $(ORACLE_VENV) $(MAXTEXT_VENV) runs build dist site *.egg-info
