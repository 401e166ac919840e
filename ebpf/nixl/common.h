/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Maps, build-specific offsets and small helpers shared by the NIXL probes.
 *
 * Read-only: every probe only reads the traced process's memory (bpf_probe_read_user)
 * and writes to its own maps.
 */
#ifndef KVSCOPE_NIXL_COMMON_H
#define KVSCOPE_NIXL_COMMON_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "nixl_event.h"

#define NIXL_IN_PROG 1
#define NIXL_ERR_NO_TELEMETRY (-12)
#define MAX_SUMMED_DESCS 65536

/*
 * Struct offsets of the traced libnixl build, set by the agent before loading from its
 * offsets table (agent/src/nixl/offsets.rs), keyed by the library's GNU build-id.
 * `offsets_known` = 0 for a build not in the table: then no probe dereferences a NIXL
 * struct and only calls, statuses and latencies are reported.
 */
const volatile __u64 offsets_known = 0;
const volatile __u64 off_agent_data = 0;     /* nixlAgent → nixlAgentData* */
const volatile __u64 off_data_name = 0;      /* nixlAgentData → std::string name */
const volatile __u64 off_req_remote = 0;     /* nixlXferReqH → std::string remoteAgent */
const volatile __u64 off_req_op = 0;         /* nixlXferReqH → nixl_xfer_op_t */
const volatile __u64 off_req_bytes = 0;      /* nixlXferReqH → telemetry totalBytes */
const volatile __u64 off_req_descs = 0;      /* nixlXferReqH → telemetry descCount */
/* When the two above hold the transfer's: COUNTS_* (agent/src/nixl/offsets.rs, `Counts`) */
const volatile __u64 req_counts_known = 0;
#define COUNTS_NEVER 0
#define COUNTS_ALWAYS 1
#define COUNTS_WITH_TELEMETRY 2 /* when the byte at nixlAgentData + off_data_telemetry is set */
const volatile __u64 off_data_telemetry = 0;
const volatile __u64 off_req_notif = 0;      /* nixlXferReqH → std::string notifMsg */
const volatile __u64 off_req_has_notif = 0;  /* nixlXferReqH → bool hasNotif */
const volatile __u64 off_dlist_begin = 0;    /* nixlDescList → descriptors vector begin */
const volatile __u64 desc_stride = 0;        /* sizeof(nixlBlobDesc) */
const volatile __u64 off_desc_len = 0;       /* nixlBlobDesc → len */
const volatile __u64 off_req_status = 0;     /* nixlXferReqH → nixl_status_t status */
/* The span of the request holding every field above a post reads (strings with their
 * inline characters): read in one bpf_probe_read_user, each costing ~80 ns here. */
const volatile __u64 off_req_window = 0;
const volatile __u64 req_window_len = 0;     /* < REQ_WINDOW */
#define REQ_WINDOW 256

/*
 * Completion sites (agent/src/nixl/offsets.rs, `TransferSites`): probes on single
 * instructions inside NIXL's methods, on paths that run once per transfer end, so that
 * nothing fires on the busy-polled getXferStatus until a transfer's status changes and
 * nothing on a release unless the transfer is still in flight. Where a site finds a
 * value is build-specific too: SRC_REG | register, SRC_FRAME | offset below the
 * frame pointer, SRC_FRAME_REF | offset of a slot holding a 32-bit value's address,
 * SRC_REG_REF | register holding a 32-bit value's address, or SRC_CONST | the value a
 * path returns without storing it. 0 = this build has no sites (the status-call probes are attached).
 */
#define SRC_REG (1ull << 32)
#define SRC_FRAME (2ull << 32)
#define SRC_CONST (3ull << 32) /* the low 32 bits are the value (a status) */
#define SRC_FRAME_REF (4ull << 32) /* a frame slot holding the address of a 32-bit value */
#define SRC_REG_REF (5ull << 32) /* a register holding the address of a 32-bit value */
#define REG_RBX 0
#define REG_RBP 1
#define REG_R12 2
#define REG_R13 3
#define REG_R14 4
#define REG_R15 5
/* Caller-saved: only at a failure site before any call (an argument still in place). */
#define REG_RAX 6
#define REG_RCX 7
#define REG_RDX 8
#define REG_RSI 9
#define REG_RDI 10
#define REG_R8 11
#define REG_R9 12
#define REG_R10 13
#define REG_R11 14
/* createXferReq's and makeXferReq's failure paths (one probe each; its cookie: the
 * status's source, FAILED_REQUEST_BUILT once the request holds the op and remote agent,
 * FAILED_IN_MAKE for makeXferReq): `this`, the op before the request is built, the frame
 * slot holding the remote agent name's address (createXferReq's argument), and the
 * request once built. */
#define FAILED_REQUEST_BUILT (1ull << 40)
#define FAILED_IN_MAKE (1ull << 41)
/* Bits 42-46: 1 + the REG_* holding `this` on this path, where it is not in the method's
 * usual place (0: site_create_agent / site_make_agent). */
#define FAILED_AGENT_SHIFT 42
const volatile __u64 site_create_agent = 0;
const volatile __u64 site_create_op = 0;
const volatile __u64 site_create_remote_ref = 0;
const volatile __u64 site_create_request = 0;
const volatile __u64 site_make_agent = 0;
const volatile __u64 site_make_op = 0;
const volatile __u64 site_make_request = 0;
const volatile __u64 site_post_status = 0;   /* postXferReq's status at its site */
const volatile __u64 site_done_req = 0;      /* the request at getXferStatus' sites */
const volatile __u64 site_stale_status = 0;  /* what its stale-remote path returns */
const volatile __u64 site_release_req = 0;   /* the request at releaseXferReq's site */

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} events SEC(".maps");

/* Records lost (index 0): ring buffer reservations that failed, and posts whose slot
 * another thread's post took (`posts`); user space reports them as lost. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} lost SEC(".maps");

/* A call in progress on one thread, from its uprobe to its uretprobe. */
struct call_entry {
	__u64 ts_ns;
	__u64 agent;
	__u64 arg;   /* a pointer the return probe needs (out parameter or name) */
	__u64 arg2;  /* another (createXferReq's remote agent name) */
	__u64 bytes;
	__u32 descs;
	__s32 op;
	__u32 flags;
	__u32 name_len;
	char name[NIXL_NAME_LEN];
};

struct call_key {
	__u64 pid_tgid;
	__u32 call;
	__u32 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct call_key);
	__type(value, struct call_entry);
} calls SEC(".maps");

/*
 * postXferReq in progress on a thread, from its entry to its site (or return): one slot
 * per thread, at its id modulo POST_SLOTS, tagged with the thread. An array slot is a
 * plain store and load, where a per-thread hash entry costs a hash, a lock and a copy
 * of a whole call_entry on both sides (BENCHMARKS.md: ~80 ns a post's entry instead of
 * 150-230, its site ~215 instead of ~255). A post entered while its slot
 * is taken (another thread in postXferReq whose id shares the slot, or an earlier post of
 * this thread that never returned through its site) loses that one: counted as lost.
 * Uncounted only: two such threads entering within the same few nanoseconds, both finding
 * the slot free (an atomic exchange would close it, but needs BPF ISA v3 for every
 * program), and a post already running when the probes were attached (as before).
 */
#define POST_SLOTS 16384
struct post_entry {
	__u64 pid_tgid; /* the thread in postXferReq; 0: free */
	__u64 ts_ns;
	__u64 agent;
	__u64 req;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, POST_SLOTS);
	__type(key, __u32);
	__type(value, struct post_entry);
} posts SEC(".maps");

/* Posted requests awaiting their first terminal status (struct inflight_entry). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct xfer_key);
	__type(value, struct inflight_entry);
} inflight SEC(".maps");

/*
 * Transfers counted in the kernel (struct xfer_tally), where the build's offsets are
 * known: every transfer's figures are exact here, so its record may be left unsent.
 * Preallocated (kernels before 6.1 refuse other hash maps in tracing programs): 512
 * series of ~19 KiB by default (the agent's `tally_series`), plus one spare per CPU:
 * 9.5 MiB per traced library on a small host, ~14 MiB on one of 224 CPUs.
 * A transfer of a series that finds the table full is not lost: its record is sent
 * untallied and the agent counts it. Entries
 * are deleted by user space once their process is gone. Updated with atomic adds (a
 * pair's transfers end on any CPU); only max_ns is a plain compare-and-store.
 */
#define TALLY_SERIES 512
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, TALLY_SERIES);
	__type(key, struct tally_key);
	__type(value, struct xfer_tally);
} xfer_tallies SEC(".maps");

/* A zeroed tally to make new entries from (too big for the BPF stack). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xfer_tally);
} tally_zero SEC(".maps");

/*
 * Which tallied transfers' records are sent: every failure, every one carrying a
 * notification (the request join reads it), every one slower than `slow_ns` (0: none
 * for that alone), and one in `sample_every` of the rest (1: all). Set at load.
 */
const volatile __u64 sample_every = 1;
const volatile __u64 slow_ns = 0;

/* Transfers since the last one sampled, per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} sample_count SEC(".maps");

/* getXferStatus in progress on a thread for an in-flight request: the request. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u64);
} polling SEC(".maps");

/* Agents already announced to user space, per process. */
struct agent_key {
	__u32 pid;
	__u32 _pad;
	__u64 agent;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct agent_key);
	__type(value, __u8);
} agents SEC(".maps");

/* The agent each CPU found in `agents` (or put there) last: a loop of one agent's calls
 * skips the hash lookup. Only a shortcut: `agents` stays the record of what was announced. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct agent_key);
} last_agent SEC(".maps");

/* The request's window (`off_req_window`), read once per post; per CPU (a program runs
 * to its end on one CPU). Past REQ_WINDOW so that a field at a bounded offset fits. */
struct req_window {
	__u8 b[REQ_WINDOW + 32];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct req_window);
} req_windows SEC(".maps");

/* One zeroed entry to start a call_entry from (too big for the BPF stack to zero
 * cheaply every time). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct call_entry);
} scratch SEC(".maps");

/* The value a site's `src` names, read from the registers or the frame at the site. */
static __always_inline __u64 site_value(struct pt_regs *ctx, __u64 src)
{
	__u64 v = src & 0xffffffffull;
	if ((src >> 32) == (SRC_REG >> 32) || (src >> 32) == (SRC_REG_REF >> 32)) {
		__u64 r = 0;
		/* Each register read where it is named: the compiler would otherwise merge the
		 * loads into one at a computed offset from ctx, which the verifier refuses. */
		switch (v) {
		case REG_RBX: r = ctx->rbx; barrier_var(r); break;
		case REG_RBP: r = ctx->rbp; barrier_var(r); break;
		case REG_R12: r = ctx->r12; barrier_var(r); break;
		case REG_R13: r = ctx->r13; barrier_var(r); break;
		case REG_R14: r = ctx->r14; barrier_var(r); break;
		case REG_R15: r = ctx->r15; barrier_var(r); break;
		case REG_RAX: r = ctx->rax; barrier_var(r); break;
		case REG_RCX: r = ctx->rcx; barrier_var(r); break;
		case REG_RDX: r = ctx->rdx; barrier_var(r); break;
		case REG_RSI: r = ctx->rsi; barrier_var(r); break;
		case REG_RDI: r = ctx->rdi; barrier_var(r); break;
		case REG_R8: r = ctx->r8; barrier_var(r); break;
		case REG_R9: r = ctx->r9; barrier_var(r); break;
		case REG_R10: r = ctx->r10; barrier_var(r); break;
		case REG_R11: r = ctx->r11; barrier_var(r); break;
		}
		if ((src >> 32) == (SRC_REG >> 32))
			return r;
		__u32 x = 0;
		if (r)
			bpf_probe_read_user(&x, sizeof(x), (const void *)r);
		return x;
	}
	if ((src >> 32) == (SRC_CONST >> 32))
		return v;
	if ((src >> 32) == (SRC_FRAME >> 32)) {
		__u64 x = 0;
		bpf_probe_read_user(&x, sizeof(x), (const char *)ctx->rbp - v);
		return x;
	}
	if ((src >> 32) == (SRC_FRAME_REF >> 32)) {
		__u64 addr = 0;
		__u32 x = 0;
		bpf_probe_read_user(&addr, sizeof(addr), (const char *)ctx->rbp - v);
		if (addr)
			bpf_probe_read_user(&x, sizeof(x), (const void *)addr);
		return x;
	}
	return 0;
}

static __always_inline void count_lost(void)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&lost, &zero);
	if (n)
		*n += 1;
}

/*
 * Submit without waking the agent for every record (a wake-up per record costs the
 * traced process a context switch on a busy node): the agent drains the ring on a short
 * timer, and is woken only once a quarter of the ring is waiting.
 */
#define WAKEUP_BYTES ((1 << 22) / 4)

static __always_inline void event_submit(struct nixl_event *e)
{
	__u64 waiting = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	bpf_ringbuf_submit(e, waiting >= WAKEUP_BYTES ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

static __always_inline struct nixl_event *event_reserve(__u32 kind)
{
	struct nixl_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_lost();
		return 0;
	}
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	e->kind = kind;
	e->pid = pid_tgid >> 32;
	e->tid = (__u32)pid_tgid;
	e->status = 0;
	e->ts_ns = bpf_ktime_get_ns();
	e->latency_ns = 0;
	e->agent = 0;
	e->data = 0;
	e->req = 0;
	e->bytes = 0;
	e->descs = 0;
	e->op = -1;
	e->call = 0;
	e->flags = offsets_known ? FLAG_OFFSETS_KNOWN : 0;
	e->name[0] = 0;
	return e;
}

/*
 * Copy the characters of a libstdc++ std::string (its data pointer and length already
 * read; NUL-terminated) into `dst`. Returns the bytes copied without the NUL, 0 when
 * unreadable; sets FLAG_NAME_TRUNCATED in `flags` when the string is longer than the
 * buffer.
 */
static __always_inline __u32 std_string_chars(char *dst, const char *data, __u64 len,
					      __u32 *flags)
{
	long n = data ? bpf_probe_read_user_str(dst, NIXL_NAME_LEN, data) : 0;
	if (n <= 0) {
		dst[0] = 0;
		return 0;
	}
	if (len >= NIXL_NAME_LEN)
		*flags |= FLAG_NAME_TRUNCATED;
	return (__u32)(n - 1);
}

/* A libstdc++ std::string (data pointer at +0, length at +8) into `dst`, as above. */
static __always_inline __u32 read_std_string(char *dst, const void *str, __u32 *flags)
{
	const char *data = 0;
	__u64 len = 0;
	if (!str || bpf_probe_read_user(&data, sizeof(data), str) != 0) {
		dst[0] = 0;
		return 0;
	}
	bpf_probe_read_user(&len, sizeof(len), (const char *)str + 8);
	return std_string_chars(dst, data, len, flags);
}

/* The per-thread entry of `call`, or 0. */
static __always_inline struct call_key call_key_of(__u32 call)
{
	struct call_key k = {};
	k.pid_tgid = bpf_get_current_pid_tgid();
	k.call = call;
	return k;
}

/* A zeroed call entry stamped now, to fill and store with store_call(). */
static __always_inline struct call_entry *new_call(__u64 agent)
{
	__u32 zero = 0;
	struct call_entry *c = bpf_map_lookup_elem(&scratch, &zero);
	if (!c)
		return 0;
	__builtin_memset(c, 0, sizeof(*c));
	c->ts_ns = bpf_ktime_get_ns();
	c->agent = agent;
	c->op = -1;
	return c;
}

static __always_inline void store_call(__u32 call, struct call_entry *c)
{
	struct call_key k = call_key_of(call);
	bpf_map_update_elem(&calls, &k, c, BPF_ANY);
}

/* Take (look up and delete) this thread's entry for `call` into `out`. */
static __always_inline int take_call(__u32 call, struct call_entry *out)
{
	struct call_key k = call_key_of(call);
	struct call_entry *c = bpf_map_lookup_elem(&calls, &k);
	if (!c)
		return -1;
	__builtin_memcpy(out, c, sizeof(*out));
	bpf_map_delete_elem(&calls, &k);
	return 0;
}

/*
 * Announce `agent` the first time this process's probes see it, with its name read
 * through the build's offsets when known (the constructor announces agents created
 * after attachment; this covers those created before).
 */
static __always_inline void note_agent(__u64 agent)
{
	if (!agent)
		return;
	struct agent_key k = {};
	k.pid = bpf_get_current_pid_tgid() >> 32;
	k.agent = agent;
	__u32 zero = 0;
	struct agent_key *last = bpf_map_lookup_elem(&last_agent, &zero);
	if (last && last->pid == k.pid && last->agent == agent)
		return;
	if (last)
		*last = k;
	if (bpf_map_lookup_elem(&agents, &k))
		return;
	__u8 one = 1;
	bpf_map_update_elem(&agents, &k, &one, BPF_ANY);
	struct nixl_event *e = event_reserve(EV_AGENT_SEEN);
	if (!e)
		return;
	e->agent = agent;
	if (offsets_known) {
		__u64 data = 0;
		bpf_probe_read_user(&data, sizeof(data), (const char *)agent + off_agent_data);
		e->data = data;
		if (data)
			read_std_string(e->name, (const char *)data + off_data_name, &e->flags);
	}
	event_submit(e);
}

#endif
