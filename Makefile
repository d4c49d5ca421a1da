# Two commands set everything up on a fresh clone:  `make train`  and  `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel; GPU users install a CUDA build of torch into .venv first (see README).
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv train test clean

venv: $(BIN)/meshloom

$(BIN)/meshloom: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Only install torch when none is present, so an existing CUDA build is kept.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install --disable-pip-version-check -e ".[test,eval,ray,k8s,ft,fla]"
	touch $@

train: venv
	$(BIN)/meshloom train --config configs/llama3_debug.toml $(ARGS)

# The suite starts about 140 Python processes (torchrun ranks, restarts, command-line runs); bytecode compiled
# once here spares each of them compiling meshloom again where PYTHONDONTWRITEBYTECODE keeps imports from caching it.
test: venv
	$(BIN)/python -m compileall -q meshloom
	$(BIN)/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
