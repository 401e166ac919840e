#!/usr/bin/env bash
# Captures real samples from the lab into lab/fixtures/samples/ (router log lines with
# and without ANSI colour, raw ZMQ KV event messages, a discovery store, a lab.json).
# Usage: lab/scripts/capture_samples.sh   (after `cargo build -p kvscope-lab`)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
ws="$(cd "$here/../.." && pwd)"
bin="${KVSCOPE_LAB_BIN:-$ws/target/debug/kvscope-lab}"
lab_dir="${KVSCOPE_LAB_DIR:-$ws/.lab}"
py="$lab_dir/venv/bin/python"
out="$ws/lab/fixtures/samples"
scratch="$lab_dir/capture"
rm -rf "$scratch"; mkdir -p "$scratch" "$out"

capture() {  # $1 = name, $2.. = extra `up` args
  local name="$1"; shift
  local run="$scratch/$name"
  "$bin" up --run-dir "$run" --num-gpu-blocks 48 "$@" > "$scratch/$name.manifest.json" 2> "$scratch/$name.up.err" &
  local up_pid=$!
  for _ in $(seq 1 600); do [ -s "$run/lab.json" ] && break; sleep 0.2; done
  [ -s "$run/lab.json" ] || { echo "lab did not start; see $scratch/$name.up.err" >&2; kill "$up_pid"; exit 1; }
  local fe ep
  fe=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["frontend_url"])' "$run/lab.json")
  ep=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["workers"][0]["kv_events_endpoint"])' "$run/lab.json")
  rm -rf "$scratch/$name.discovery"; cp -r "$run/discovery" "$scratch/$name.discovery"  # deleted on shutdown
  "$py" "$here/dump_kv_events.py" "$ep" --count 2000 --seconds 30 --out "$scratch/$name.events.jsonl" &
  local dump_pid=$!
  sleep 1
  "$bin" workload --frontend "$fe" --sessions 16 --families 2 --concurrency 8 --max-turns 4 \
    --duration 20 --out "$scratch/$name.workload.json" > "$scratch/$name.summary.json" || true
  sleep 1
  kill "$dump_pid" 2>/dev/null || true; wait "$dump_pid" 2>/dev/null || true
  kill -INT "$up_pid"; wait "$up_pid" || true
}

capture ansi --ansi-logs
capture plain

"$py" "$here/select_samples.py" "$scratch" "$out"
echo "samples written to $out"
