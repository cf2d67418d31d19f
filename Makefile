# rMLX: `make run` and `make test` do all set-up themselves (see README.md).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
# CI builds once from clean: incremental state would only cost time and disk.
ifdef CI
export CARGO_INCREMENTAL ?= 0
endif

.PHONY: run generate test scripts-test bootstrap build lint fmt-check clippy cargo-test sdk-deps agents-deps ui-deps ui-build ui-test app-deps app-test clean-mlx bench soak fuzz packaging-test bottle

## Provide the pinned MLX + mlx-c pair under .mlx/ (idempotent; apt packages when root).
bootstrap:
	@scripts/bootstrap-toolchain
	@scripts/bootstrap-mlx
	@scripts/app-deps

# The UI is built first: `rmlx serve` embeds ui/dist at compile time.
build: bootstrap ui-build
	$(CARGO) build --release --bin rmlx

## The main job: rMLX.app on the bundled tiny models (random weights, so answers are gibberish;
## the timings are real). With a display (or on macOS) the app starts with its window open; with
## none, `rmlx serve` hosts the same UI and API on 127.0.0.1 and prints the URL to open.
MODELS ?= tests/fixtures/qwen3-tiny:tests/fixtures/qwen3-vl-tiny
PORT ?= 8080
run: build
	target/release/rmlx doctor
	@if [ "$$(uname)" = Darwin ] || [ -n "$${DISPLAY:-}$${WAYLAND_DISPLAY:-}" ]; then \
	  $(CARGO) build --release -p rmlx-app && \
	  RMLX_APP_MODELS="$(MODELS)" RMLX_APP_SHOW=1 target/release/rmlx-app; \
	else \
	  echo "make run: no display, so the UI is served in the browser instead of the app window"; \
	  target/release/rmlx serve --port $(PORT) $(foreach m,$(subst :, ,$(MODELS)),--model $(m)); \
	fi

## The command-line main job of earlier sessions: one generation from the tiny Qwen3.
MODEL ?= tests/fixtures/qwen3-tiny
PROMPT ?= What is the capital of France?
generate: build
	target/release/rmlx info --model $(MODEL)
	target/release/rmlx generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 48

fmt-check: bootstrap
	$(CARGO) fmt --all -- --check

clippy: bootstrap ui-build
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## The official Python and TypeScript SDKs the SDK tests drive (pinned, idempotent).
sdk-deps:
	@scripts/sdk-venv
	@scripts/sdk-node

## The coding agents tests/agents runs against `rmlx serve` (pinned npm packages, idempotent).
agents-deps:
	@scripts/agents-deps

cargo-test: bootstrap sdk-deps agents-deps ui-build
	RMLX_REQUIRE_SDK=1 RMLX_REQUIRE_AGENTS=1 $(CARGO) test --workspace

## The web UI (ui/): lint, unit tests, then the browser suite in headless Chromium against a
## real `rmlx serve` on the tiny fixtures (the debug binary cargo-test built).
ui-deps:
	@scripts/ui-deps

## The app embeds ui/dist at compile time: it must exist before cargo builds the workspace.
ui-build: ui-deps
	cd ui && npm run build

# `cargo test --no-run` builds the binaries exactly as cargo-test did (same feature set), so
# after cargo-test it does nothing; `cargo build` would resolve features anew and rebuild.
ui-test: ui-deps
	$(CARGO) test --workspace --no-run
	cd ui && npm run lint && npm test && RMLX_BIN=$(CURDIR)/target/debug/rmlx npm run e2e

## The real app headless (Linux): tray over D-Bus, persistence, busy port, a screenshot.
app-test: bootstrap ui-build
	$(CARGO) test --workspace --no-run
	@if [ "$$(uname)" = Linux ]; then scripts/app-test; else echo "app-test: Linux only (no Xvfb on macOS)"; fi

lint: fmt-check clippy

## The set-up scripts' own promises (apt waits for a held dpkg lock; no direct apt-get calls).
scripts-test:
	tests/scripts/apt-lock.sh

## The Homebrew formula and cask, the bottle flow and the release's version agreement
## (tests/packaging/; seconds; no Homebrew: Ruby syntax and DSL, brew's real JSON, a fake brew).
packaging-test:
	tests/packaging/run.sh

test: scripts-test packaging-test fmt-check clippy cargo-test ui-test app-test

# Every server the tests start keeps its disk prefix cache off (one test's conversations would
# be another's disk hits); the disk cache's own tests turn it on in folders of their own.
cargo-test ui-test app-test: export RMLX_PREFIX_DISK_GB := 0

## A Homebrew bottle of packaging/homebrew/rmlx.rb for this machine (a Mac with Homebrew), renamed
## to its release asset name, and the `bottle do` block to paste (docs/RELEASING.md). Not part of
## `make test`. ROOT_URL, TAP, OUT, SOURCE_TARBALL, WRITE=1: see the script.
bottle:
	scripts/release/build_bottle.sh

## SOAK_MINUTES (5) of mixed traffic against a real server, with the load test's end checks
## (not part of `make test`).
SOAK_MINUTES ?= 5
soak: bootstrap
	SOAK_MINUTES=$(SOAK_MINUTES) $(CARGO) test -p rmlx-server --test load -- --ignored soak --nocapture

## Every parser fuzz target for FUZZ_S seconds (300) each; what it finds is replayed by
## `make test` (crates/rmlx-server/tests/fuzz_replay.rs). Not part of `make test`.
FUZZ_S ?= 300
fuzz: bootstrap
	FUZZ_S=$(FUZZ_S) scripts/fuzz

## rmlx vs mlx-lm on benchmark-sized random checkpoints (not part of `make test`).
bench:
	scripts/bench/run

clean-mlx:
	rm -rf .mlx
