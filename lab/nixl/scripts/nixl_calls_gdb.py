# gdb script: counts calls of libnixl.so's nixlAgent / nixlAgentData methods and the
# nixl_status_t each returned, per thread kind (the process's main thread or another).
# A slow but independent oracle to check the lab's truth (and uprobes) against.
#
#   eval "$(kvscope-nixl-lab env)"           # so the lab does not re-exec itself
#   NIXL_CALLS_OUT=/tmp/calls.json gdb -q -batch -x lab/nixl/scripts/nixl_calls_gdb.py \
#       --args target/debug/kvscope-nixl-lab run --truth-out /tmp/truth.json
#
# Output (JSON): {"<function>": {"calls": n, "returns": {"<code>": n}, "threads":
# {"main": n, "other": n}}}. Only in-process runs (gdb does not follow the worker
# processes of `run --processes`).

import json
import os

import gdb

FUNCTIONS = [
    "nixlAgent::getLocalMD",
    "nixlAgent::loadRemoteMD",
    "nixlAgent::fetchRemoteMD",
    "nixlAgent::sendLocalMD",
    "nixlAgent::checkRemoteMD",
    "nixlAgent::makeConnection",
    "nixlAgent::invalidateRemoteMD",
    "nixlAgent::registerMem",
    "nixlAgent::deregisterMem",
    "nixlAgent::createXferReq",
    "nixlAgent::makeXferReq",
    "nixlAgent::prepXferDlist",
    "nixlAgent::postXferReq",
    "nixlAgent::getXferStatus",
    "nixlAgent::releaseXferReq",
    "nixlAgent::genNotif",
    "nixlAgent::getNotifs",
    "nixlAgent::createBackend",
    "nixlAgent::getPluginParams",
    "nixlAgentData::loadRemoteMD",
    "nixlAgentData::getLocalMD",
    "nixlAgentData::invalidateRemoteMD",
]

# Functions whose return type is not nixl_status_t.
NO_STATUS = set()

stats = {}


def entry(name):
    return stats.setdefault(name, {"calls": 0, "returns": {}, "threads": {"main": 0, "other": 0}})


class Return(gdb.FinishBreakpoint):
    def __init__(self, frame, name):
        super().__init__(frame, internal=True)
        self.silent = True
        self.fname = name

    def stop(self):
        rax = int(gdb.parse_and_eval("$rax")) & 0xFFFFFFFF
        code = rax - (1 << 32) if rax & 0x80000000 else rax
        r = entry(self.fname)["returns"]
        r[str(code)] = r.get(str(code), 0) + 1
        return False

    def out_of_scope(self):
        r = entry(self.fname)["returns"]
        r["lost"] = r.get("lost", 0) + 1


class Entry(gdb.Breakpoint):
    def __init__(self, spec):
        super().__init__(spec, internal=False)
        self.silent = True
        self.spec = spec

    def stop(self):
        frame = gdb.newest_frame()
        # gdb also puts a location on every PLT stub of the name (in libnixl_capi.so
        # and in libnixl.so itself): count only the function's own code in libnixl.so.
        so = gdb.solib_name(frame.pc()) or ""
        if not so.endswith("/libnixl.so") or "@plt" in (frame.name() or ""):
            return False
        fn = frame.function()
        name = fn.print_name if fn is not None else self.spec
        if ".cold" in name:
            return False
        # keep overloads apart by their parameter list, shortened
        key = name.split("(")[0]
        if "makeXferReq" in key or "prepXferDlist" in key:
            key = name.replace("std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >", "string")
        e = entry(key)
        e["calls"] += 1
        thread = gdb.selected_thread()
        main = thread.ptid[1] == thread.ptid[0]
        e["threads"]["main" if main else "other"] += 1
        if key not in NO_STATUS:
            Return(frame, key)
        return False


gdb.execute("set pagination off")
gdb.execute("set breakpoint pending on")
gdb.execute("set confirm off")
for f in FUNCTIONS:
    Entry(f)


def on_exit(event):
    out = os.environ.get("NIXL_CALLS_OUT", "/dev/stdout")
    with open(out, "w") as fh:
        json.dump(stats, fh, indent=1, sort_keys=True)


gdb.events.exited.connect(on_exit)
gdb.execute("run")
