#!/usr/bin/env bash
# The packaging tests (`make packaging-test`, part of `make test`; seconds, no Homebrew needed):
# test_packaging.py (formula and cask syntax and content, versions, pins, the bottle JSON
# handling against real `brew bottle --json` output, build_bottle.sh against a fake brew), then
# mutations.py (each repository check fails when what it checks is broken).
set -euo pipefail
cd "$(dirname "$0")"
../../scripts/packaging-deps
python3 -m unittest -q test_packaging
python3 mutations.py
