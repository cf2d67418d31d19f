# rMLX: `make run` and `make test` do all set-up themselves (see README.md).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo

.PHONY: run test bootstrap build lint fmt-check clippy cargo-test sdk-deps ui-deps ui-build ui-test app-deps app-test clean-mlx bench

## Provide the pinned MLX + mlx-c pair under .mlx/ (idempotent; apt packages when root).
bootstrap:
	@scripts/bootstrap-toolchain
	@scripts/bootstrap-mlx
	@scripts/app-deps

build: bootstrap
	$(CARGO) build --release --bin rmlx

## The main job: check MLX, then generate from the bundled tiny Qwen3 (random weights, so the
## text is gibberish; the timings are real).
MODEL ?= tests/fixtures/qwen3-tiny
PROMPT ?= What is the capital of France?
run: build
	target/release/rmlx doctor
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

cargo-test: bootstrap sdk-deps ui-build
	RMLX_REQUIRE_SDK=1 $(CARGO) test --workspace

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

test: fmt-check clippy cargo-test ui-test app-test

## rmlx vs mlx-lm on benchmark-sized random checkpoints (not part of `make test`).
bench:
	scripts/bench/run

clean-mlx:
	rm -rf .mlx
