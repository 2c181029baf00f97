#!/usr/bin/env bash
# Seconds from `make serve` in a fresh clone of this repository (no pip cache) to the
# first answer of /healthz: what a new user waits. Usage: bash bench/serve_time.sh [PORT]
set -euo pipefail
port=${1:-18330}
repo=$(cd "$(dirname "$0")/.." && pwd)
if curl -fsS "http://127.0.0.1:$port/healthz" > /dev/null 2>&1; then
  echo "something already answers on port $port: pass another port" >&2
  exit 2
fi
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill -- -"$pid" 2> /dev/null; sleep 1; rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work"
cd "$work"
start=$(date +%s.%N)
R3STORE_PORT=$port PIP_NO_CACHE_DIR=1 setsid make serve > "$work/serve.log" 2>&1 &
pid=$!  # setsid: make and the server in a process group of their own, stopped at exit
for _ in $(seq 1 1200); do
  if curl -fsS "http://127.0.0.1:$port/healthz" > /dev/null 2>&1; then
    python3 -c "import sys; print(f'make serve to /healthz: {float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" \
      "$start" "$(date +%s.%N)"
    du -sh "$work/.venv" | awk '{print "virtualenv: " $1}'
    exit 0
  fi
  sleep 0.25
done
echo "no answer from /healthz after 300 s; the log:" >&2
tail -20 "$work/serve.log" >&2
exit 1
