# rMLX: `make run` and `make test` do all set-up themselves (see README.md).
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo

.PHONY: run test bootstrap build lint fmt-check clippy cargo-test clean-mlx

## Provide the pinned MLX + mlx-c pair under .mlx/ (idempotent; apt packages when root).
bootstrap:
	@scripts/bootstrap-toolchain
	@scripts/bootstrap-mlx

build: bootstrap
	$(CARGO) build --release --bin rmlx

## The main job. Until the engine generates text: check MLX end to end from Rust.
run: build
	target/release/rmlx doctor

fmt-check: bootstrap
	$(CARGO) fmt --all -- --check

clippy: bootstrap
	$(CARGO) clippy --workspace --all-targets -- -D warnings

cargo-test: bootstrap
	$(CARGO) test --workspace

lint: fmt-check clippy

test: fmt-check clippy cargo-test

clean-mlx:
	rm -rf .mlx
