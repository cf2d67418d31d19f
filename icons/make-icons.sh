#!/usr/bin/env bash
# Makes the icon set Tauri reads (src-tauri/icons/: the PNG sizes, icon.icns, icon.ico, the ones
# tauri.conf.json's bundle.icon lists) from the one source image, icons/source.png (1024x1024).
# Run it after changing the source, then commit the result; builds do not run it.
#
# The tool is Tauri's own `tauri icon` (@tauri-apps/cli, pinned to the tauri crate's version),
# the one that made the committed set: it reproduces every PNG and the ICO byte for byte, and an
# ICNS with the same images (its chunk order varies between runs).
#
# The tray icons are sources too and need no generation: src-tauri/src/tray.rs embeds
# icons/tray-template@2x.png (44x44; tray-template.png is its 22x22 1x version), a black shape on
# transparency that macOS tints as a template image.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tauri_cli_version=2.12.5
source_png="$root/icons/source.png"
dest="$root/src-tauri/icons"
# What the app uses: bundle.icon's list, plus the 64px and 512px PNGs Linux desktops pick from.
wanted=(32x32.png 64x64.png 128x128.png 128x128@2x.png icon.png icon.icns icon.ico)

command -v npx >/dev/null || { echo "make-icons: npx (Node.js) is needed" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# `tauri icon` also writes Windows Store, iOS and Android sets; only the desktop set is kept.
npx --yes "@tauri-apps/cli@$tauri_cli_version" icon "$source_png" --output "$tmp/out" >"$tmp/log" 2>&1 ||
  { cat "$tmp/log" >&2; echo "make-icons: tauri icon failed" >&2; exit 1; }
mkdir -p "$dest"
for name in "${wanted[@]}"; do
  [ -f "$tmp/out/$name" ] || { echo "make-icons: tauri icon made no $name" >&2; exit 1; }
  cp "$tmp/out/$name" "$dest/$name"
done
echo "make-icons: ${wanted[*]} -> ${dest#"$root"/}"
