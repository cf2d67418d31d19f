#!/usr/bin/env bash
# The device tool sends the whole working tree, at most 64 MiB of it, and the fixtures' weights
# are ~93 MB of it (the goldens 9 MB, the fuzz corpus 11 MB). `aside.sh out` moves every
# tests/fixtures/**/*.safetensors and golden*.json to .bench/aside (ignored, so it does not travel) for the device calls; `aside.sh back` returns
# them. The bench needs only the fixtures' tokenizers, which stay. If a session ends between the
# two, `git checkout -- tests/fixtures` restores the files as well.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
aside=.bench/aside
case ${1:-} in
  out)
    git ls-files 'tests/fixtures/*.safetensors' 'tests/fixtures/*golden*.json' | while read -r f; do
      [[ -f $f ]] || continue
      mkdir -p "$aside/$(dirname "$f")" && mv "$f" "$aside/$f"
    done
    # The fuzz corpus (~11 MB of small files) is not needed there either.
    if [[ -d fuzz/corpus ]]; then mkdir -p "$aside/fuzz" && mv fuzz/corpus "$aside/fuzz/corpus"; fi ;;
  back)
    [[ -d $aside ]] || exit 0
    if [[ -d $aside/fuzz/corpus && ! -e fuzz/corpus ]]; then mv "$aside/fuzz/corpus" fuzz/corpus; fi
    (cd "$aside" && find . -type f \( -name '*.safetensors' -o -name '*golden*.json' \)) | while read -r f; do
      f=${f#./}; mkdir -p "$(dirname "$f")" && mv "$aside/$f" "$f"
    done
    git diff --quiet -- tests/fixtures || { echo "aside.sh: fixtures differ from git" >&2; exit 1; } ;;
  *) echo "usage: aside.sh out|back" >&2; exit 2 ;;
esac
