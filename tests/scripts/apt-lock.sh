#!/usr/bin/env bash
# scripts/apt-get waits for a held dpkg lock (as unattended-upgrades holds it on a fresh Debian
# box at boot) instead of failing, and says so; plain apt-get fails at once. Also: no script
# calls apt-get directly. Needs root and apt (Debian); elsewhere it says why it did not run.
set -euo pipefail
cd "$(dirname "$0")/../.."
bad=$(grep -rnE '(^|[;&|{ ]|sudo )(env [A-Z_=]+ )?apt-get (install|update|upgrade)' scripts Makefile \
  | grep -v '^scripts/apt-get:' | grep -vE '(echo|die) "' || true)
if [ -n "$bad" ]; then
  echo "apt-lock: these call apt-get directly; use scripts/apt-get (it waits for the dpkg lock):" >&2
  echo "$bad" >&2
  exit 1
fi
if [ "$(uname)" != Linux ] || ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
  echo "apt-lock: static check passed; the lock test needs root and apt-get (not run here)"
  exit 0
fi
hold() {
  python3 -c 'import fcntl, os, sys, time
fd = os.open("/var/lib/dpkg/lock-frontend", os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[1]))' "$1"
}
# Plain apt-get gives up at once while the lock is held.
coproc HOLDER { hold 3; }
holder=$HOLDER_PID
read -r _ <&"${HOLDER[0]}"
if apt-get -o DPkg::Lock::Timeout=0 check -qq 2>/dev/null; then
  echo "apt-lock: plain apt-get did not see the held lock (the test would prove nothing)" >&2
  exit 1
fi
wait "$holder" 2>/dev/null || true
# The wrapper waits, says so, and succeeds once the lock is free.
coproc HOLDER { hold 3; }
holder=$HOLDER_PID
read -r _ <&"${HOLDER[0]}"
start=$(date +%s)
message=$(scripts/apt-get check -qq 2>&1 >/dev/null)
elapsed=$(( $(date +%s) - start ))
wait "$holder" 2>/dev/null || true
[ "$elapsed" -ge 2 ] || { echo "apt-lock: scripts/apt-get returned after ${elapsed}s, before the lock was free" >&2; exit 1; }
case "$message" in
  *"waiting up to"*) ;;
  *) echo "apt-lock: no waiting message, got: $message" >&2; exit 1 ;;
esac
echo "apt-lock: scripts/apt-get waited ${elapsed}s for a held dpkg lock and then succeeded"
