# Sourced by the NIXL benchmark scripts (not a command): one `kvscope agent` attached to
# a libnixl.so with nowhere to send (NATS at 127.0.0.1:1), its /metrics on loopback.
#
#   start_nixl_agent BIN LIB LOG [AGENT ARGS…]
#     starts it, waits until its probes are attached (`nixl_library_info` on /metrics),
#     and sets NIXL_AGENT_PID and NIXL_AGENT_PORT; prints the log and exits 1 if it
#     does not attach.
start_nixl_agent() {
  local bin="$1" lib="$2" log="$3"
  shift 3
  NIXL_AGENT_PORT=$((20000 + RANDOM % 10000))
  "$bin" agent --nats-url nats://127.0.0.1:1 --nixl-lib "$lib" --no-nixl-discover \
    --metrics-listen "127.0.0.1:$NIXL_AGENT_PORT" "$@" >"$log" 2>&1 &
  NIXL_AGENT_PID=$!
  for _ in $(seq 200); do
    curl -sf "http://127.0.0.1:$NIXL_AGENT_PORT/metrics" 2>/dev/null | grep -q nixl_library_info && return 0
    kill -0 "$NIXL_AGENT_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "$(basename "$0"): the agent did not attach its probes:" >&2; cat "$log" >&2; exit 1
}
