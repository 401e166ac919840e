#!/usr/bin/env python3
"""Dump raw ZMQ multipart messages from a vLLM-format KV event publisher (e.g. a Dynamo
mocker started with --zmq-kv-events-ports) as JSON lines, every frame base64- and
hex-encoded, plus a best-effort msgpack decode for reading (msgspec or msgpack, optional).

    python dump_kv_events.py tcp://127.0.0.1:PORT [--count N] [--seconds S] [--out FILE]
"""
import argparse
import base64
import json
import sys
import time

import zmq

try:
    import msgspec  # type: ignore

    def _unpack(b):
        return msgspec.msgpack.decode(b)
except ImportError:  # the decoded view is optional
    try:
        import msgpack  # type: ignore

        def _unpack(b):
            return msgpack.unpackb(b, raw=False, strict_map_key=False)
    except ImportError:
        _unpack = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", default="-")
    args = ap.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(args.endpoint)
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    print(f"subscribed to {args.endpoint}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + args.seconds
    n = 0
    while n < args.count and time.monotonic() < deadline:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            continue
        rec = {
            "endpoint": args.endpoint,
            "frames_b64": [base64.b64encode(f).decode() for f in frames],
            "frames_hex": [f.hex() for f in frames],
        }
        if _unpack is not None and len(frames) == 3:
            try:
                rec["decoded_payload"] = _unpack(frames[2])
                rec["seq"] = int.from_bytes(frames[1], "big")
            except Exception as e:  # noqa: BLE001
                rec["decode_error"] = str(e)
        out.write(json.dumps(rec, default=lambda o: o.hex() if isinstance(o, bytes) else repr(o)) + "\n")
        out.flush()
        n += 1
    print(f"captured {n} messages", file=sys.stderr)


if __name__ == "__main__":
    main()
