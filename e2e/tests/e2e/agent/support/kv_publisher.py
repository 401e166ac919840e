"""A vLLM-style KV event publisher for the agent's tests.

Binds a ZMQ XPUB socket (a PUB that also sees subscriptions, so the test never races
the slow-joiner problem), waits for the first subscriber, then sends every message of a
JSON spec: {"messages": [{"frames_hex": ["", "00..01", "93cb..."]}, ...]}. Frames are hex
so the spec can hold any bytes, including malformed payloads. Prints "subscribed" and
"sent N" on stdout, then lingers (keeping the socket up) until stdin closes.
"""
import json
import sys
import time

import zmq


def main() -> None:
    endpoint, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(endpoint)
    print("bound", flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if not poller.poll(30_000):
        print("no subscriber", flush=True)
        sys.exit(2)
    sub = sock.recv()
    print("subscribed", sub.hex(), flush=True)
    n = 0
    for m in spec["messages"]:
        frames = [bytes.fromhex(h) for h in m["frames_hex"]]
        sock.send_multipart(frames)
        n += 1
        time.sleep(float(spec.get("interval_secs", 0.01)))
    print("sent", n, flush=True)
    sys.stdin.read()
    sock.close()
    ctx.term()


if __name__ == "__main__":
    main()
