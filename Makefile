PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install demo test

# torch 2.13.0 (CPU build) lies on disk on the project's machines; the package itself only needs torch>=2.6.
install:
	$(PIP) "torch==2.13.0" && $(PIP) -e ".[dev]"

demo: install
	$(PY) -m echo_tp.cli demo

test: install
	$(PY) -m pytest -q tests
