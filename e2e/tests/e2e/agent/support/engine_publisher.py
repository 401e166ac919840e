"""An engine's own KV event publisher — vLLM's or SGLang's, run unmodified from its
wheel — for the agent's tests.

Usage: engine_publisher.py VERSION_DIR RELAY_ENDPOINT REPLAY_ENDPOINT IPC_PATH

VERSION_DIR holds a wheel's publisher module: vLLM's `vllm/distributed/kv_events.py`
(scripts/setup extracts it under .lab/vllm/<version>) or SGLang's
`sglang/srt/disaggregation/kv_events.py` (.lab/sglang/<version>). Its
`ZmqEventPublisher` is the publisher the engine runs: its classes encode the events, its
thread numbers and sends the batches, its ROUTER answers replays from its buffer. What
the module imports from the rest of its engine (a logger, a config record, a type alias,
endpoint and topology helpers the ipc:// endpoint at data-parallel rank 0 never calls)
is stood in for here; nothing of the publisher itself is.

The publisher binds IPC_PATH (ipc://: vLLM binds rather than connects there, and nothing
leaves the machine); a relay in this process forwards its batches to a PUB bound on
RELAY_ENDPOINT, which the agent taps, and drops the sequence numbers it is told to (the
losses a real network or a slow subscriber causes). The replay socket is the
publisher's own, on REPLAY_ENDPOINT.

Commands, one JSON object per line on stdin, each answered by one JSON line on stdout:
  {"cmd": "fields"}                      the engine, its event classes' fields, and
                                         whether events are positional (array_like) or maps
  {"cmd": "start", "buffer_steps": N}    a new publisher (an engine start or restart:
                                         numbering from 0, an empty replay buffer; the
                                         one before it shut down first); its
                                         first batches are empty probes the relay drops
                                         until one reaches it: answers {"probes": n}
  {"cmd": "stop"}                        shut the publisher down
  {"cmd": "drop", "range": [a, b]}       the relay drops numbers a..b-1 (until the next start)
  {"cmd": "relay_restart"}               the relay's subscribers lose their connection
                                         (a new PUB on the same port)
  {"cmd": "publish", "batches": [..]}    each batch {"ts", "events": [{"type", fields…}],
                                         "data_parallel_rank"?}; hashes given as
                                         {"bytes": hex} are sent as bytes; answers with
                                         the numbers the batches were given once the relay
                                         has seen them all
  {"cmd": "publish_many", "n": N, "first_hash": H}
                                         N batches of one one-block BlockStored each,
                                         hashes H, H+1, …, chained
"""

import importlib.util
import inspect
import json
import logging
import pathlib
import sys
import threading
import time
import types

import msgspec
import zmq


def load_publisher_module(version_dir):
    """The wheel's publisher module, its imports from the rest of the engine stood in for."""

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__path__ = []
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class KVEventsConfig:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    def not_called(*_args, **_kwargs):
        raise RuntimeError("a helper the ipc:// endpoint at rank 0 does not need was called")

    root = pathlib.Path(version_dir)
    vllm = root / "vllm" / "distributed" / "kv_events.py"
    sglang = root / "sglang" / "srt" / "disaggregation" / "kv_events.py"
    if vllm.is_file():
        for name in ["vllm", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"]:
            module(name)
        # Before 0.11 the config record came from vllm.config itself.
        module("vllm.config", KVEventsConfig=KVEventsConfig)
        module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
        module("vllm.logger", init_logger=logging.getLogger)
        module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
        module(
            "vllm.utils.network_utils",
            get_ip=not_called,
            get_tcp_uri=not_called,
            is_valid_ipv6_address=not_called,
            split_zmq_path=not_called,
        )
        path, name = vllm, "vllm.distributed.kv_events"
    else:
        for name in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"]:
            module(name)
        module("sglang.srt.runtime_context", get_parallel=not_called)
        module("sglang.srt.utils.network", NetworkAddress=not_called)
        path, name = sglang, "sglang.srt.disaggregation.kv_events"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Relay:
    """SUB → PUB, dropping the sequence numbers in `drop`; counts what it saw."""

    def __init__(self, ctx, source, relay_endpoint):
        self.ctx = ctx
        self.endpoint = relay_endpoint
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(source)
        self.pub = self.bind()
        self.drop = set()
        self.drop_all = False
        self.seen = []
        self.lock = threading.Lock()
        threading.Thread(target=self.run, daemon=True).start()

    def bind(self):
        # libzmq closes a socket in its I/O thread: the port is free a moment later.
        deadline = time.monotonic() + 10
        while True:
            pub = self.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            try:
                pub.bind(self.endpoint)
                return pub
            except zmq.ZMQError as e:
                pub.close(linger=0)
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def restart(self):
        """Drop the subscribers' connections (a network blip): a new PUB on the port."""
        with self.lock:
            self.pub.close(linger=0)
            self.pub = self.bind()

    def run(self):
        while True:
            frames = self.sub.recv_multipart()
            seq = int.from_bytes(frames[-2], "big")
            with self.lock:
                self.seen.append(seq)
                if self.drop_all or seq in self.drop:
                    continue
                self.pub.send_multipart(frames)

    def reset(self, drop_all=False):
        with self.lock:
            self.drop = set()
            self.drop_all = drop_all
            self.seen = []

    def wait_seen(self, n, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.seen) >= n:
                    return True
            time.sleep(0.005)
        return False


def hash_value(h):
    return bytes.fromhex(h["bytes"]) if isinstance(h, dict) else h


def main():
    version_dir, relay_endpoint, replay_endpoint, ipc_path = sys.argv[1:5]
    kv = load_publisher_module(version_dir)
    ctx = zmq.Context.instance()
    source = f"ipc://{ipc_path}"
    relay = Relay(ctx, source, relay_endpoint)
    publisher = None
    published = 0
    classes = {c.__name__: c for c in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)}
    positional = bool(getattr(kv.KVCacheEvent, "__struct_config__").array_like)
    # The data-parallel rank comes first (vLLM's data_parallel_rank since 0.10, SGLang's
    # attn_dp_rank); vLLM 0.9's publisher takes none.
    params = list(inspect.signature(kv.ZmqEventPublisher.__init__).parameters)
    rank = () if params[1] == "endpoint" else (0,)

    def event(spec):
        spec = dict(spec)
        cls = classes[spec.pop("type")]
        known = set(cls.__struct_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} of this vLLM has no field {unknown}")
        if "block_hashes" in spec:
            spec["block_hashes"] = [hash_value(h) for h in spec["block_hashes"]]
        if spec.get("parent_block_hash") is not None:
            spec["parent_block_hash"] = hash_value(spec["parent_block_hash"])
        if spec.get("extra_keys") is not None:
            spec["extra_keys"] = [tuple(k) if k is not None else None for k in spec["extra_keys"]]
        # Required fields the test leaves out are None (what vLLM passes for them).
        fields = cls.__struct_fields__
        for f in fields[: len(fields) - len(cls.__struct_defaults__)]:
            spec.setdefault(f, None)
        return cls(**spec)

    def publish(batches):
        nonlocal published
        first = published
        for b in batches:
            # vLLM names the rank data_parallel_rank, SGLang attn_dp_rank: by position;
            # vLLM 0.9's batches have none.
            fields = [b.get("ts", time.time()), [event(e) for e in b["events"]]]
            if len(kv.KVEventBatch.__struct_fields__) > 2:
                fields.append(b.get("data_parallel_rank"))
            batch = kv.KVEventBatch(*fields)
            publisher.publish(batch)
            published += 1
        if not relay.wait_seen(published):
            raise RuntimeError(f"the relay saw {len(relay.seen)} of {published} batches")
        return list(range(first, published))

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req["cmd"]
        try:
            if cmd == "fields":
                out = {
                    "engine": kv.__name__.split(".")[0],
                    "positional": positional,
                    **{name: list(c.__struct_fields__) for name, c in classes.items()},
                    "KVEventBatch": list(kv.KVEventBatch.__struct_fields__),
                }
            elif cmd == "start":
                if publisher is not None:
                    # The engine before it goes away first (its sockets closed).
                    publisher.shutdown()
                # libzmq closes a socket in its I/O thread: the old engine's replay port
                # is free a moment after shutdown (a real engine's, when its process ends).
                deadline = time.monotonic() + 10
                while True:
                    try:
                        publisher = kv.ZmqEventPublisher(
                            *rank,
                            endpoint=source,
                            replay_endpoint=replay_endpoint,
                            buffer_steps=req.get("buffer_steps", 10_000),
                        )
                        break
                    except zmq.ZMQError as e:
                        if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
                # The relay's SUB reconnects to the new socket (every 100 ms) and
                # subscribes: until an empty probe batch gets to it, batches are lost
                # before the test's own. The probes go no further (the agent gets them
                # through the replay socket, as a tap that started late).
                relay.reset(drop_all=True)
                published = 0
                deadline = time.monotonic() + 20
                while True:
                    publisher.publish(kv.KVEventBatch(time.time(), []))
                    published += 1
                    if relay.wait_seen(1, timeout=0.2):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError("the relay never reached the publisher")
                time.sleep(0.1)
                relay.reset()
                with relay.lock:
                    relay.seen = list(range(published))
                out = {"probes": published}
            elif cmd == "stop":
                publisher.shutdown()
                publisher = None
                out = {"stopped": True}
            elif cmd == "relay_restart":
                relay.restart()
                out = {"restarted": True}
            elif cmd == "drop":
                with relay.lock:
                    relay.drop = set(range(*req["range"]))
                out = {"dropping": len(relay.drop)}
            elif cmd == "publish":
                out = {"seqs": publish(req["batches"])}
            elif cmd == "publish_many":
                h = req["first_hash"]
                batches = []
                for i in range(req["n"]):
                    batches.append(
                        {
                            "ts": time.time(),
                            "events": [
                                {
                                    "type": "BlockStored",
                                    "block_hashes": [h + i],
                                    "parent_block_hash": h + i - 1 if i else None,
                                    "token_ids": [i % 1000] * 4,
                                    "block_size": 4,
                                }
                            ],
                        }
                    )
                seqs = publish(batches)
                out = {"first": seqs[0], "last": seqs[-1]}
            else:
                out = {"error": f"unknown command {cmd!r}"}
        except Exception as e:  # the test reads the reason
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    if publisher is not None:
        publisher.shutdown()


if __name__ == "__main__":
    main()
