/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The one record the NIXL probes send to user space through the ring buffer.
 *
 * Mirrored field by field in agent/src/nixl/event.rs (`RawEvent::SIZE` and the decoder's
 * offsets are checked against this layout by a unit test that reads this header), so
 * change both together. Fixed-size, naturally aligned, no padding holes.
 */
#ifndef KVSCOPE_NIXL_EVENT_H
#define KVSCOPE_NIXL_EVENT_H

#define NIXL_NAME_LEN 64

/* What happened (`kind`). */
enum nixl_event_kind {
	/* A nixlAgent constructor returned: `agent`, `data` (its nixlAgentData), `name`. */
	EV_AGENT_NEW = 1,
	/* First probe hit from an agent whose constructor we did not see: `agent`, and its
	 * `name` when the build's offsets are known. */
	EV_AGENT_SEEN = 2,
	/* createXferReq / makeXferReq returned: `call`, `req`, `status`, `op`, `name`
	 * (remote agent, createXferReq only), `latency_ns` (0 from a create-failure site,
	 * which sees no entry). */
	EV_XFER_CREATE = 3,
	/* postXferReq returned: `req`, `status`, `latency_ns` (the call itself), and with
	 * known offsets `op`, `bytes`, `descs`, `name` (remote agent) read from the request. */
	EV_XFER_POST = 4,
	/* getXferStatus first returned a terminal status for a posted request: `req`,
	 * `status`, `latency_ns` = post entry → this return. */
	EV_XFER_DONE = 5,
	/* releaseXferReq entered: `req`, `flags` & FLAG_IN_FLIGHT when still in progress. */
	EV_XFER_RELEASE = 6,
	/* A metadata / handshake / notification / memory call returned: `call`, `status`,
	 * `latency_ns`, `name` (remote agent where the call carries it), `bytes` and
	 * `descs` for (de)registerMem. */
	EV_CALL = 7,
	/* postXferReq returned for a request carrying a notification (known offsets only),
	 * just before its EV_XFER_POST: `req`, `agent`, `name` = the notification message
	 * (FLAG_NAME_TRUNCATED past 63 bytes). vLLM's NixlConnector names the request in it. */
	EV_XFER_NOTIF = 8,
};

/* Calls reported with EV_CALL or EV_XFER_CREATE (`call`); also the uprobe cookie. */
enum nixl_call {
	CALL_LOAD_REMOTE_MD = 1,       /* nixlAgent::loadRemoteMD */
	CALL_LOAD_REMOTE_MD_ASYNC = 2, /* nixlAgentData::loadRemoteMD outside of it */
	CALL_FETCH_REMOTE_MD = 3,
	CALL_SEND_LOCAL_MD = 4,
	CALL_MAKE_CONNECTION = 5,
	CALL_CHECK_REMOTE_MD = 6,
	CALL_INVALIDATE_REMOTE_MD = 7,
	CALL_GEN_NOTIF = 8,
	CALL_GET_NOTIFS = 9,
	CALL_REGISTER_MEM = 10,
	CALL_DEREGISTER_MEM = 11,
	CALL_CREATE_XFER_REQ = 12,
	CALL_MAKE_XFER_REQ = 13,
	CALL_AGENT_CTOR = 14,
	CALL_POST_XFER_REQ = 15,
	CALL_GET_XFER_TELEMETRY = 16, /* only its refusals: NIXL_ERR_NO_TELEMETRY, no latency */
};

/* `flags` */
#define FLAG_OFFSETS_KNOWN (1u << 0) /* op/bytes/descs/remote came from the request */
#define FLAG_NAME_TRUNCATED (1u << 1)
#define FLAG_IN_FLIGHT (1u << 2)     /* released before a terminal status was seen */
#define FLAG_BYTES_PARTIAL (1u << 3) /* more descriptors than the probe sums */
#define FLAG_BYTES_UNKNOWN (1u << 4) /* a post whose request holds no byte count to read */
/* The transfer's figures were counted in the kernel (`xfer_tallies`); its record is
 * sent for spans and the request join only, and carries what its tally is keyed by
 * (agent, op, bytes, descs, name = remote agent) whichever record it is. */
#define FLAG_TALLIED (1u << 5)
/* Why a tallied transfer's record was sent (any of them): */
#define FLAG_KEPT_FAILURE (1u << 6) /* a failed status, or released in flight */
#define FLAG_KEPT_NOTIF (1u << 7)   /* it carries a notification */
#define FLAG_KEPT_SLOW (1u << 8)    /* slower than `slow_ns` */
#define FLAG_KEPT_SAMPLED (1u << 9) /* one in `sample_every` of the rest */

struct nixl_event {
	__u32 kind;
	__u32 pid; /* tgid */
	__u32 tid;
	__s32 status; /* nixl_status_t */
	__u64 ts_ns;  /* bpf_ktime_get_ns at the event */
	__u64 latency_ns;
	__u64 agent; /* nixlAgent* (nixlAgentData* for CALL_LOAD_REMOTE_MD_ASYNC) */
	__u64 data;  /* nixlAgentData* (EV_AGENT_NEW) */
	__u64 req;   /* nixlXferReqH* */
	__u64 bytes;
	__u32 descs;
	__s32 op; /* 0 READ, 1 WRITE, -1 unknown */
	__u32 call;
	__u32 flags;
	char name[NIXL_NAME_LEN];
};

/*
 * The kernel's tallies of transfers, where the build's offsets are known: per (process,
 * local agent, remote agent, op, stage, status), exact counts, bytes, descriptors and a
 * latency histogram. Mirrored in agent/src/nixl/tally.rs (checked against this header by
 * a unit test).
 *
 * Latency buckets (ns), log-linear: below LAT_SUB each value its own bucket; above, each
 * power of two split in LAT_SUB equal buckets (1/64 of the octave: a value read back as
 * its bucket's middle is within 0.8%), up to 2^(LAT_TOP_OCTAVE + 1) ns (~37 min), beyond
 * which everything counts in the last bucket. Besides, counts per LATENCY_BOUNDS_NS bucket
 * (wire/src/nixl.rs: the bounds Prometheus histograms show), exact at those bounds.
 */
#define LAT_SUB_BITS 6
#define LAT_SUB (1 << LAT_SUB_BITS)
#define LAT_TOP_OCTAVE 40
#define LAT_FINE ((LAT_TOP_OCTAVE - LAT_SUB_BITS + 2) << LAT_SUB_BITS)
#define LAT_BOUNDS 22
#define LAT_FIXED (LAT_BOUNDS + 1) /* the last: above every bound */
#define LAT_BOUNDS_NS                                                                    \
	{ 1000ull, 2500ull, 5000ull, 10000ull, 25000ull, 50000ull, 100000ull, 250000ull,   \
	  500000ull, 1000000ull, 2500000ull, 5000000ull, 10000000ull, 25000000ull,          \
	  50000000ull, 100000000ull, 250000000ull, 500000000ull, 1000000000ull,             \
	  2500000000ull, 5000000000ull, 10000000000ull }

/* `stage` of a tally (wire's XferStage; creations that fail are records only). */
enum xfer_stage {
	STAGE_POST = 1,               /* postXferReq returned an error */
	STAGE_COMPLETE = 2,           /* a terminal status, at the post or later */
	STAGE_RELEASED_IN_FLIGHT = 3, /* released before any terminal status */
};

struct tally_key {
	__u32 pid;
	__s32 status;
	__u64 agent; /* nixlAgent* */
	__s32 op;
	__u32 stage;
	char remote[NIXL_NAME_LEN];
};

/* A posted request awaiting its first terminal status (the `inflight` map's value, keyed
 * by process and request): when it was posted, and what its tally is keyed by. */
struct xfer_key {
	__u32 pid;
	__u32 _pad;
	__u64 req;
};

struct inflight_entry {
	__u64 ts_ns; /* post entry */
	__u64 agent;
	__u64 bytes;
	__u32 descs;
	__s32 op;
	__u32 flags; /* FLAG_BYTES_UNKNOWN, and FLAG_KEPT_* already decided at the post */
	__u32 _pad;
	char remote[NIXL_NAME_LEN]; /* "" where the build's offsets are unknown */
};

struct xfer_tally {
	__u64 count;
	__u64 bytes;
	__u64 descs;
	__u64 bytes_unknown; /* of count: no byte count read (neither bytes nor descs added) */
	__u64 sum_ns;        /* latency: the complete stage only */
	__u64 max_ns;
	__u64 fixed[LAT_FIXED];
	__u64 fine[LAT_FINE];
};

#endif
