"""Drives a nixl-cu12 wheel through its own Python API (`nixl_cu12._api`), the way an
engine does, and writes what it did as JSON: the truth the agent's probes are checked
against (e2e/tests/e2e/agent/nixl_wheel_api.rs).

Two agents in this process, each with 8 blocks of DRAM registered (and 300 pages in one
registration of 300 descriptors on one of them): metadata exchanged
both ways (two loadRemoteMD that succeed) and one corrupt blob (one that fails); a READ
and a WRITE of 1..8 blocks from py-b to py-a, each with a notification in vLLM's format,
polled to done, its telemetry asked for as vLLM asks (refused where telemetry is off),
released; one transfer toward an agent never loaded (its creation fails); one genNotif.

The wheel's older APIs import torch at import time only for tensor inputs: a stub module
stands in (no tensor is passed here).

    python wheel_driver.py OUT.json      (PYTHONPATH: the wheel's package and numpy)
"""

import ctypes
import json
import os
import sys
import time
import types

BLOCK = 64 * 1024
BLOCKS = 8
PAGE = 4096
PAGES = 300

if "torch" not in sys.modules:
    torch = types.ModuleType("torch")

    class Tensor:  # isinstance() checks only
        pass

    torch.Tensor = Tensor
    sys.modules["torch"] = torch

from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: E402


def agent(name):
    a = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf = ctypes.create_string_buffer(BLOCK * BLOCKS)
    addr = ctypes.addressof(buf)
    a.register_memory([(addr, BLOCK * BLOCKS, 0, "")], "DRAM")
    return a, buf, addr


def main(out):
    a, _abuf, a_addr = agent("py-a")
    b, _bbuf, b_addr = agent("py-b")
    # One registration of many small descriptors (more than a probe could unroll).
    pages = ctypes.create_string_buffer(PAGE * PAGES)
    base = ctypes.addressof(pages)
    b.register_memory([(base + i * PAGE, PAGE, 0, "") for i in range(PAGES)], "DRAM")
    registered = 2 * BLOCK * BLOCKS + PAGE * PAGES
    handshakes = {"ok": 0, "failed": 0}
    for x, y in ((a, b), (b, a)):
        x.add_remote_agent(y.get_agent_metadata())
        handshakes["ok"] += 1
    try:
        b.add_remote_agent(b"\x00not NIXL metadata\x00")
        handshakes["ok"] += 1
    except Exception:  # noqa: BLE001 - the API raises its own error types per version
        handshakes["failed"] += 1

    def descs(owner, base, n):
        return owner.get_xfer_descs([(base + i * BLOCK, BLOCK, 0) for i in range(n)], "DRAM")

    transfers = []
    refused = 0
    seq = 0
    for n in range(1, BLOCKS + 1):
        for op in ("READ", "WRITE"):
            seq += 1
            notif = f"py-req-{seq}:1".encode()
            h = b.initialize_xfer(op, descs(b, b_addr, n), descs(a, a_addr, n), "py-a", notif)
            state = b.transfer(h)
            deadline = time.monotonic() + 30
            while state == "PROC" and time.monotonic() < deadline:
                state = b.check_xfer_state(h)
            if state != "DONE":
                raise SystemExit(f"transfer {seq} ended {state}")
            try:
                b.get_xfer_telemetry(h)
            except Exception:  # noqa: BLE001 - NIXL_ERR_NO_TELEMETRY
                refused += 1
            b.release_xfer_handle(h)
            transfers.append({"op": op, "descriptors": n, "bytes": n * BLOCK, "notif": notif.decode()})
    unknown_created = 0
    try:
        b.initialize_xfer("READ", descs(b, b_addr, 1), descs(a, a_addr, 1), "py-nobody")
    except Exception:  # noqa: BLE001 - NIXL_ERR_NOT_FOUND
        unknown_created += 1
    b.send_notif("py-a", b"py-hello")
    deadline = time.monotonic() + 10
    got = 0
    while got < len(transfers) + 1 and time.monotonic() < deadline:
        got += sum(len(v) for v in a.get_new_notifs().values())
    truth = {
        "pid": os.getpid(),
        "local": "py-b",
        "remote": "py-a",
        "transfers": transfers,
        "handshakes": handshakes,
        "creations_toward_unknown": unknown_created,
        "telemetry_refused": refused,
        "gen_notif": 1,
        "registered_bytes": registered,
        "notifications_received": got,
    }
    with open(out, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main(sys.argv[1])
