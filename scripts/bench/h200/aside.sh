#!/usr/bin/env bash
# The device tool sends the whole working tree, at most 64 MiB of it, and the fixtures' weights
# are ~93 MB of it. `aside.sh out` moves every tests/fixtures/**/*.safetensors
# to .bench/aside (ignored, so it does not travel) for the device calls; `aside.sh back` returns
# them. The bench needs only the fixtures' tokenizers, which stay. If a session ends between the
# two, `git checkout -- tests/fixtures` restores the files as well.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
aside=.bench/aside
case ${1:-} in
  out)
    git ls-files 'tests/fixtures/*.safetensors' | while read -r f; do
      [[ -f $f ]] || continue
      mkdir -p "$aside/$(dirname "$f")" && mv "$f" "$aside/$f"
    done ;;
  back)
    [[ -d $aside ]] || exit 0
    (cd "$aside" && find . -type f -name '*.safetensors') | while read -r f; do
      f=${f#./}; mkdir -p "$(dirname "$f")" && mv "$aside/$f" "$f"
    done
    git diff --quiet -- tests/fixtures || { echo "aside.sh: fixtures differ from git" >&2; exit 1; } ;;
  *) echo "usage: aside.sh out|back" >&2; exit 2 ;;
esac
