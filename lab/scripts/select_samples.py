#!/usr/bin/env python3
"""Picks the committed samples out of a capture_samples.sh scratch dir."""
import json
import re
import shutil
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def router_excerpt(log: Path, decisions: int = 6) -> list[str]:
    """~30 consecutive lines around the first few routing decisions after warm-up."""
    lines = log.read_text(errors="replace").splitlines(keepends=True)
    idx = [i for i, l in enumerate(lines) if "Selected worker" in l]
    if not idx:
        return []
    # Start at the [ROUTING_INPUT] that precedes a decision well into the run.
    start_sel = idx[min(len(idx) - 1, len(idx) // 3)]
    start = start_sel
    while start > 0 and "ROUTING_INPUT" not in lines[start]:
        start -= 1
    end = start
    seen = 0
    while end < len(lines) and (seen < decisions or end - start < 30):
        if "Selected worker" in lines[end]:
            seen += 1
        end += 1
    return lines[start:end]


def event_kinds(rec):
    p = rec.get("decoded_payload")
    if not isinstance(p, list) or len(p) < 2:
        return []
    return [e.get("type") if isinstance(e, dict) else (e[0] if e else None) for e in p[1]]


def main() -> None:
    scratch, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)

    ansi = router_excerpt(scratch / "ansi" / "frontend.log")
    (out / "router_log_ansi.log").write_text("".join(ansi))
    plain = router_excerpt(scratch / "plain" / "frontend.log")
    (out / "router_log_plain.log").write_text("".join(plain))
    assert all("\x1b" not in l for l in plain), "plain log has ANSI escapes"

    # ZMQ messages: a few of each kind, in publisher order, from one worker.
    msgs = [json.loads(l) for l in (scratch / "plain.events.jsonl").read_text().splitlines() if l]
    picked, counts = [], {}
    want = {"BlockStored": 4, "BlockRemoved": 3, "AllBlocksCleared": 1}
    first_parented = next((m for m in msgs if any(
        isinstance(e, dict) and e.get("type") == "BlockStored" and e.get("parent_block_hash") is not None
        for e in m["decoded_payload"][1])), None)
    for m in msgs:
        kinds = event_kinds(m)
        take = any(counts.get(k, 0) < want.get(k, 0) for k in kinds) or m is first_parented
        if take:
            for k in kinds:
                counts[k] = counts.get(k, 0) + 1
            picked.append(m)
    doc = {
        "description": (
            "Raw ZMQ multipart messages from a Dynamo 1.6.1 mocker's --zmq-kv-events-ports "
            "publisher (vLLM wire format): frames [topic, seq u64 BE, msgpack payload], each "
            "base64 and hex; decoded_payload is msgspec's decode, for reading only. "
            "Lab: block_size 16, num_gpu_blocks 48. Messages are in publish order "
            "(seq increases; gaps are messages not selected)."
        ),
        "worker": json.loads((scratch / "plain" / "lab.json").read_text())["workers"][0],
        "counts_in_capture": {},
        "messages": picked,
    }
    for m in msgs:
        for k in event_kinds(m):
            doc["counts_in_capture"][k] = doc["counts_in_capture"].get(k, 0) + 1
    (out / "kv_events_mocker.json").write_text(json.dumps(doc, indent=1) + "\n")

    disc = out / "discovery"
    if disc.exists():
        shutil.rmtree(disc)
    shutil.copytree(scratch / "plain.discovery", disc)
    shutil.copy(scratch / "plain" / "lab.json", out / "lab.json")
    print(f"router lines: ansi {len(ansi)}, plain {len(plain)}; zmq messages {len(picked)} "
          f"of {len(msgs)}; kinds in capture {doc['counts_in_capture']}")


if __name__ == "__main__":
    main()
