# Two entry points for a fresh machine with only python3 and pip:
#   make demo   set up .venv if needed, then run the drift demo
#   make test   set up .venv if needed, then run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean

setup: $(STAMP)

# A machine whose python3 already has a CUDA torch (a GPU box) reuses it through
# --system-site-packages; anywhere else torch is pinned to the CPU build so pip
# never pulls a multi-GB CUDA wheel.
$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "qstate: using the GPU torch of $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		echo "qstate: no GPU torch found; installing the CPU build torch==2.13.0"; \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[dev,notebooks,hf]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/qstate drift --model nemotron-h-8b --out report --force

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

clean:
	rm -rf $(VENV) report
