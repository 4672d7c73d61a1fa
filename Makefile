# Two commands on a fresh machine:
#   make demo   set up .venv and run the main job (2 ranks train a transformer under
#               @spmd.parallelize; plan, loss and step time against torch DDP)
#   make test   set up .venv and run the test suite (what .ci/run calls)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch 2.13.0; pyproject.toml itself accepts a range.
TORCH  ?= torch==2.13.0

.PHONY: setup demo test test-fast test-long bench clean torch-suites

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train.py

test: $(STAMP)
	$(PY) -m pytest

# the edit loop: a slice of every layer in under 3 minutes (tests/tiers.py, FAST)
test-fast: $(STAMP)
	SPMD_TESTS=fast $(PY) -m pytest

# everything, the long profile (tests/tiers.py) included
test-long: $(STAMP)
	SPMD_TESTS=all $(PY) -m pytest

# PyTorch's own distributed tests with their imports pointed at spmd.runtime, all of them
# (make test runs a sample); counts by suite and each failure's cause at the end
torch-suites: $(STAMP)
	-SPMD_TORCH_SUITES=all $(PY) -m pytest tests/torch_suites -q -p no:warnings \
	    --junitxml=torch-suites.xml
	$(PY) -m tests.torch_suites.report torch-suites.xml

bench: $(STAMP)
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/batch_sizes.py
	$(PY) benchmarks/fsdp.py
	$(PY) benchmarks/zero.py
	$(PY) benchmarks/tp.py
	$(PY) benchmarks/tp.py --model llama
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/auto.py
	$(PY) benchmarks/compressed.py
	$(PY) benchmarks/hardware.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/planning.py
	$(PY) benchmarks/planning.py --strategy fsdp
	$(PY) benchmarks/store.py
	$(PY) benchmarks/collectives.py --overhead
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/rpc.py

clean:
	rm -rf $(VENV) build dist *.egg-info
