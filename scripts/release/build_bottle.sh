#!/usr/bin/env bash
# Builds the rmlx bottle on this machine and prints what the release needs (docs/RELEASING.md,
# "The bottle"): the bottle renamed to its GitHub Release asset name and the `bottle do` block.
# Needs Homebrew; the real bottles are built on Apple-Silicon Macs (tags arm64_sequoia,
# arm64_sonoma, …: one run per macOS version you bottle for). `make bottle` runs it.
#
#   1. copies packaging/homebrew/rmlx.rb into the tap TAP (created with `brew tap-new` when
#      missing; `brew tap rmlx/tap` first to work in the published tap's clone),
#   2. brew install --build-bottle TAP/rmlx,
#   3. brew bottle --json --root-url=ROOT_URL TAP/rmlx (in OUT),
#   4. renames NAME--VERSION.TAG.bottle.tar.gz (brew's local name) to NAME-VERSION.TAG… (the
#      name Homebrew downloads from ROOT_URL) and prints the `bottle do` block from the JSON
#      (scripts/release/bottle-json; tests/packaging/ checks it against real brew output),
#   5. with WRITE=1, brew bottle --merge --write --no-commit: the block goes into the tap's copy
#      of the formula (commit it there once the bottle is uploaded; packaging/homebrew/rmlx.rb
#      itself stays without one).
#
# Environment: TAP (rmlx/tap), ROOT_URL (https://github.com/rmlx/rmlx/releases/download/vVERSION,
# VERSION read from the formula's url), OUT (dist/bottles), SOURCE_TARBALL (build from this local
# tarball, e.g. before the release's tarball is uploaded: the tap's copy gets a file:// url and
# its sha256), WRITE (1: step 5).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
formula_src="$root/packaging/homebrew/rmlx.rb"
tap=${TAP:-rmlx/tap}
out=${OUT:-$root/dist/bottles}

die() { echo "build_bottle: $*" >&2; exit 1; }
command -v brew >/dev/null || die "Homebrew is needed (brew not found): run this on a Mac with Homebrew"

version=$(sed -nE 's|^  url ".*/rmlx-([0-9][^"/]*)\.tar\.gz"$|\1|p' "$formula_src")
[ -n "$version" ] || die "cannot read the version from the url in $formula_src"
root_url=${ROOT_URL:-https://github.com/rmlx/rmlx/releases/download/v$version}

# 1. The formula in a tap: --build-bottle and `brew bottle` work on tapped formulae only.
if ! brew tap | grep -qx "$tap"; then
  echo "build_bottle: creating the local tap $tap"
  brew tap-new --no-git "$tap" >/dev/null
fi
formula="$(brew --repository "$tap")/Formula/rmlx.rb"
mkdir -p "$(dirname "$formula")"
cp "$formula_src" "$formula"
if [ -n "${SOURCE_TARBALL:-}" ]; then
  [ -f "$SOURCE_TARBALL" ] || die "SOURCE_TARBALL $SOURCE_TARBALL does not exist"
  tarball=$(cd "$(dirname "$SOURCE_TARBALL")" && pwd)/$(basename "$SOURCE_TARBALL")
  if command -v shasum >/dev/null; then sha=$(shasum -a 256 "$tarball" | cut -d' ' -f1); else sha=$(sha256sum "$tarball" | cut -d' ' -f1); fi
  # Only the formula's own url / sha256 (two-space indent), not the resources' (four); the
  # version is stated since the tarball's file name may not carry it.
  URL="file://$tarball" SHA="$sha" VERSION="$version" perl -pi -e \
    's|^  url ".*"$|  url "$ENV{URL}"\n  version "$ENV{VERSION}"|; s|^  sha256 "[0-9a-f]{64}"$|  sha256 "$ENV{SHA}"|' "$formula"
  echo "build_bottle: building from $tarball ($sha)"
fi

# 2. A fresh build made for bottling.
brew uninstall --force --ignore-dependencies "$tap/rmlx" >/dev/null 2>&1 || true
brew install --build-bottle "$tap/rmlx"

# 3. The bottle and its JSON, in a folder of their own so that only this run's JSON is read.
mkdir -p "$out"
work=$(mktemp -d "$out/run.XXXXXX")
(cd "$work" && brew bottle --json --root-url="$root_url" "$tap/rmlx")
jsons=("$work"/*.bottle.json)
[ -f "${jsons[0]}" ] || die "brew bottle wrote no JSON in $work"

# 4. The asset name and the block.
assets=$("$root/scripts/release/bottle-json" rename --dir "$work" "${jsons[@]}")
block=$("$root/scripts/release/bottle-json" block "${jsons[@]}")
if [ "${WRITE:-0}" = 1 ]; then
  # 5. Into the tap's formula.
  brew bottle --merge --write --no-commit "${jsons[@]}"
  echo "build_bottle: wrote the bottle block into $formula"
fi
mv "$work"/* "$out"/
rmdir "$work"

echo
echo "Upload to the GitHub Release v$version (root_url $root_url):"
for asset in $assets; do echo "  $out/$(basename "$asset")"; done
echo
echo "Then paste this into the tap's rmlx.rb, after sha256/license (or rerun with WRITE=1):"
echo
printf '%s\n' "$block"
