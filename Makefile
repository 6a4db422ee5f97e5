# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.bootstrapped
# torch's CPU wheel when no CUDA device is present: an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: all bootstrap model emulator serve generate test test-apm lint unit bench clean

all: test

bootstrap: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "bootstrap: no CUDA device, installing the CPU build of torch"; \
		$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

model: bootstrap
	$(VENV)/bin/tierserve models pull

serve: model
	$(VENV)/bin/tierserve serve

generate: model
	$(VENV)/bin/tierserve generate "$(PROMPT)"

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

unit: bootstrap
	$(PY) -m pytest -q -m "not slow"

# QEMU's user-mode emulator, for tests/worker/test_emulated_cpu.py: the engine's CPU-specific tests in a
# process whose CPUID says Haswell (AVX2, no AVX-512) or Nehalem (SSE4.2), whatever this machine is. One
# static binary from Debian's registry (qemu-user-static) unpacked into .cache/qemu; no root needed
# where apt's package lists are present. Where it cannot be fetched the test skips and says why.
QEMU := .cache/qemu/qemu-x86_64
emulator:
	@test -x $(QEMU) || scripts/fetch_qemu.sh .cache/qemu

# The second pass runs the CPU-specific paths (tests marked `isa`: engine, daemon, packing, the real
# model end to end) again as on an AVX2-only CPU, whatever this machine has: both paths, every machine.
test: lint model emulator
	$(PY) -m pytest -q
	@echo "make test: the CPU-specific tests again as on an AVX2-only CPU (TIERSERVE_CPU_ISA=avx2)"
	TIERSERVE_CPU_ISA=avx2 $(PY) -m pytest -q -m isa

# Traces into a real APM: Arize Phoenix (~850 MB, pinned, its own venv under .cache/) started by the test,
# which reads the spans back from Phoenix's REST API. The install retries (pip per download, then the
# whole install three times) and names what failed; only a finished one is stamped, so a broken one is
# redone. scripts/phoenix_screenshot.sh uses the same venv.
APM_VENV := .cache/apm-venv
PHOENIX_VERSION ?= 20.26.1
APM_STAMP := $(APM_VENV)/.phoenix-$(PHOENIX_VERSION)

$(APM_STAMP):
	@test -x $(APM_VENV)/bin/python || $(PYTHON) -m venv $(APM_VENV)
	@for attempt in 1 2 3; do \
		echo "test-apm: installing arize-phoenix==$(PHOENIX_VERSION) into $(APM_VENV) (attempt $$attempt of 3)"; \
		$(APM_VENV)/bin/python -m pip install -q --disable-pip-version-check --retries 5 --timeout 60 \
			"arize-phoenix==$(PHOENIX_VERSION)" && break; \
		if [ $$attempt = 3 ]; then \
			echo "test-apm: pip could not install arize-phoenix==$(PHOENIX_VERSION) (its errors are above)" >&2; \
			exit 1; \
		fi; \
		sleep 20; \
	done
	@test -x $(APM_VENV)/bin/phoenix || { echo "test-apm: no $(APM_VENV)/bin/phoenix after the install" >&2; exit 1; }
	@touch $@

test-apm: bootstrap $(APM_STAMP)
	TIERSERVE_APM_TEST=1 TIERSERVE_APM_PHOENIX=$(APM_VENV)/bin/phoenix $(PY) -m pytest -q tests/e2e/test_tracing.py -k phoenix

# make bench [SCENARIO=engine|gateway-overhead|load-smoke] [RECORD=1]: one JSON object; RECORD=1 also
# writes it into docs/benchmarks.md.
SCENARIO ?= engine
bench: model
	$(VENV)/bin/tierserve bench $(SCENARIO) --json $(if $(RECORD),--record)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
