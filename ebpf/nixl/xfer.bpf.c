/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Transfer lifecycle: create/make → post → first terminal status → release, keyed by
 * (process, request handle) so post → done latency is exact.
 *
 * Signatures (System V x86-64, `this` in rdi, 1.5.1 wheel; see DESIGN.md):
 *   createXferReq(const nixl_xfer_op_t &op, const nixlXferDList &local,
 *                 const nixlXferDList &remote, const std::string &remote_agent,
 *                 nixlXferReqH *&req, const nixl_opt_args_t *)       rsi rdx rcx r8 r9
 *   makeXferReq(nixl_xfer_op_t op, const nixlDlistH &local, span<const int> local_idx,
 *               const nixlDlistH &remote, span<const int> remote_idx,
 *               nixlXferReqH *&req, const nixl_opt_args_t *)
 *     op esi, local rdx, local_idx rcx:r8, remote r9, remote_idx on the stack
 *     (sp+8, sp+16), req at sp+24. The std::vector overload forwards to this one.
 *   Before 1.5 only that one is exported, and it is the implementation:
 *   makeXferReq(const nixl_xfer_op_t &op, const nixlDlistH *local,
 *               const std::vector<int> &local_idx, const nixlDlistH *remote,
 *               const std::vector<int> &remote_idx, nixlXferReqH *&req,
 *               const nixl_opt_args_t *)       rsi rdx rcx r8 r9, req at sp+8
 *   postXferReq(nixlXferReqH *req, const nixl_opt_args_t *)                rsi
 *   getXferStatus(nixlXferReqH *req)                                       rsi
 *   releaseXferReq(nixlXferReqH *req)                                      rsi
 *
 * Where the build's completion sites are known (common.h), the returns are seen at one
 * instruction each instead of by return probes (createXferReq's and makeXferReq's only on
 * the paths where they fail), a transfer's end at the paths
 * getXferStatus takes only when its status changes, and a release only when it finds
 * the transfer in flight: nothing
 * fires on a busy poll or a plain release. Otherwise the status-call probes below do:
 * getXferStatus is busy-polled (UCX progress runs inside it), so they do one hash lookup
 * and nothing else unless the request is in flight.
 */
#include "common.h"

/* The request's fields a post reports, in one read of its window (0: unknown build, no
 * request, or unreadable). */
static __always_inline __u8 *read_req_window(__u64 req)
{
	if (!offsets_known || !req)
		return 0;
	__u32 zero = 0;
	struct req_window *w = bpf_map_lookup_elem(&req_windows, &zero);
	if (!w)
		return 0;
	__u64 len = req_window_len & (REQ_WINDOW - 1);
	if (bpf_probe_read_user(w->b, len, (const char *)req + off_req_window) != 0)
		return 0;
	return w->b;
}

/* Where a request field at `off` is in the window. */
static __always_inline __u64 win_at(__u64 off)
{
	return (off - off_req_window) & (REQ_WINDOW - 1);
}

static __always_inline __u64 win_u64(const __u8 *w, __u64 at)
{
	__u64 v;
	__builtin_memcpy(&v, w + (at & (REQ_WINDOW - 1)), sizeof(v));
	return v;
}

/*
 * The libstdc++ std::string at `off` of the request, into `dst` (as read_std_string):
 * a short one's characters are inline, in the window already (its pointer points at
 * them, and it is shorter than the buffer); a longer one's are read.
 */
static __always_inline void win_string(char *dst, const __u8 *w, __u64 req, __u64 off,
				       __u32 *flags)
{
	__u64 at = win_at(off);
	__u64 data = win_u64(w, at);
	__u64 len = win_u64(w, at + 8);
	if (data && data == req + off + 16 && len < 16) {
		/* The inline buffer holds the characters and the terminating NUL; what follows
		 * them is an earlier string's (zeroed: a tally is keyed by the name). */
		const __u8 *chars = w + (at & (REQ_WINDOW - 1)) + 16;
		for (int i = 0; i < 16; i++)
			dst[i] = i < len ? chars[i] : 0;
		return;
	}
	std_string_chars(dst, (const char *)data, len, flags);
}

/* Whether the request of a post by `agent` holds its byte and descriptor counts: on
 * builds before 1.4, only when the agent's telemetry is enabled (a flag of its data). */
static __always_inline int counts_held(__u64 agent)
{
	if (req_counts_known == COUNTS_ALWAYS)
		return 1;
	if (req_counts_known != COUNTS_WITH_TELEMETRY || !agent)
		return 0;
	__u64 data = 0;
	__u8 enabled = 0;
	if (bpf_probe_read_user(&data, sizeof(data), (const char *)agent + off_agent_data) != 0 ||
	    !data)
		return 0;
	if (bpf_probe_read_user(&enabled, sizeof(enabled), (const char *)data + off_data_telemetry) != 0)
		return 0;
	return enabled != 0;
}

/* What the request of a post by `agent` says it moves, into `x` (zeroed): with the
 * build's offsets, its op, byte and descriptor counts and remote agent. */
static __always_inline void read_req_info(struct inflight_entry *x, __u64 req, const __u8 *w,
					  __u64 agent)
{
	x->agent = agent;
	x->op = -1;
	if (!w) {
		x->flags |= FLAG_BYTES_UNKNOWN;
		return;
	}
	__s32 op;
	__builtin_memcpy(&op, w + win_at(off_req_op), sizeof(op));
	x->op = op;
	if (counts_held(agent)) {
		x->bytes = win_u64(w, win_at(off_req_bytes));
		x->descs = (__u32)win_u64(w, win_at(off_req_descs));
	} else {
		x->flags |= FLAG_BYTES_UNKNOWN;
	}
	win_string(x->remote, w, req, off_req_remote, &x->flags);
}

/* A transfer's record carries what it moved (whichever record ends it). */
static __always_inline void fill_transfer(struct nixl_event *e, const struct inflight_entry *x)
{
	e->agent = x->agent;
	e->op = x->op;
	e->bytes = x->bytes;
	e->descs = x->descs;
	e->flags |= x->flags;
	__builtin_memcpy(e->name, x->remote, NIXL_NAME_LEN);
}

static const __u64 lat_bounds[LAT_BOUNDS] = LAT_BOUNDS_NS;

static __always_inline __u32 msb64(__u64 v)
{
	__u32 r = 0;
	if (v >> 32) { v >>= 32; r += 32; }
	if (v >> 16) { v >>= 16; r += 16; }
	if (v >> 8) { v >>= 8; r += 8; }
	if (v >> 4) { v >>= 4; r += 4; }
	if (v >> 2) { v >>= 2; r += 2; }
	if (v >> 1) r += 1;
	return r;
}

/* The latency bucket of `ns` (nixl_event.h, LAT_SUB_BITS). */
static __always_inline __u32 lat_fine(__u64 ns)
{
	if (ns < LAT_SUB)
		return (__u32)ns;
	if (ns >> (LAT_TOP_OCTAVE + 1))
		ns = (1ull << (LAT_TOP_OCTAVE + 1)) - 1;
	__u32 m = msb64(ns);
	return ((m - LAT_SUB_BITS + 1) << LAT_SUB_BITS) +
	       (__u32)((ns >> (m - LAT_SUB_BITS)) & (LAT_SUB - 1));
}

/* The LATENCY_BOUNDS_NS bucket of `ns`: the first bound it does not exceed. */
static __always_inline __u32 lat_fixed(__u64 ns)
{
	for (int i = 0; i < LAT_BOUNDS; i++)
		if (ns <= lat_bounds[i])
			return i;
	return LAT_BOUNDS;
}

/* Count one transfer in its pair's tally (`timed`: with its latency): FLAG_TALLIED, or 0
 * where the table is full (its record is then sent for the agent to count). */
static __always_inline __u32 tally(__u32 stage, __s32 status, const struct inflight_entry *x,
				   __u64 latency_ns, int timed)
{
	struct tally_key k = {};
	k.pid = bpf_get_current_pid_tgid() >> 32;
	k.status = status;
	k.agent = x->agent;
	k.op = x->op;
	k.stage = stage;
	__builtin_memcpy(k.remote, x->remote, NIXL_NAME_LEN);
	struct xfer_tally *t = bpf_map_lookup_elem(&xfer_tallies, &k);
	if (!t) {
		__u32 zero = 0;
		struct xfer_tally *z = bpf_map_lookup_elem(&tally_zero, &zero);
		if (!z)
			return 0;
		/* Another CPU may make it first: then this finds it. */
		bpf_map_update_elem(&xfer_tallies, &k, z, BPF_NOEXIST);
		t = bpf_map_lookup_elem(&xfer_tallies, &k);
		if (!t)
			return 0;
	}
	__sync_fetch_and_add(&t->count, 1);
	if (x->flags & FLAG_BYTES_UNKNOWN) {
		__sync_fetch_and_add(&t->bytes_unknown, 1);
	} else {
		__sync_fetch_and_add(&t->bytes, x->bytes);
		__sync_fetch_and_add(&t->descs, (__u64)x->descs);
	}
	if (!timed)
		return FLAG_TALLIED;
	__sync_fetch_and_add(&t->sum_ns, latency_ns);
	if (latency_ns > t->max_ns)
		t->max_ns = latency_ns;
	__u32 f = lat_fixed(latency_ns);
	if (f < LAT_FIXED)
		__sync_fetch_and_add(&t->fixed[f], 1);
	__u32 i = lat_fine(latency_ns);
	if (i < LAT_FINE)
		__sync_fetch_and_add(&t->fine[i], 1);
	return FLAG_TALLIED;
}

/* FLAG_KEPT_SAMPLED for one in `sample_every` transfers (per CPU), else 0. */
static __always_inline __u32 sampled(void)
{
	if (sample_every <= 1)
		return FLAG_KEPT_SAMPLED;
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&sample_count, &zero);
	if (!n)
		return 0;
	*n += 1;
	if (*n < sample_every)
		return 0;
	*n = 0;
	return FLAG_KEPT_SAMPLED;
}

/* Why a transfer that ended with `status` after `latency_ns` (`timed`) is sent, on top
 * of `kept` (decided at its post); 0: its tally says all. */
static __always_inline __u32 kept_at_end(__u32 kept, __s32 status, __u64 latency_ns, int timed)
{
	if (status != 0)
		kept |= FLAG_KEPT_FAILURE;
	if (timed && slow_ns && latency_ns > slow_ns)
		kept |= FLAG_KEPT_SLOW;
	return kept;
}

SEC("uprobe")
int BPF_KPROBE(create_xfer_enter, void *self, const __s32 *op, void *local, void *remote,
	       const void *remote_agent)
{
	/* libbpf 1.1 has neither a sixth BPF_KPROBE argument nor PT_REGS_PARM6. */
	void **req_out = (void **)ctx->r9;
	note_agent((__u64)self);
	struct call_entry *c = new_call((__u64)self);
	if (!c)
		return 0;
	__s32 o = -1;
	bpf_probe_read_user(&o, sizeof(o), op);
	c->op = o;
	c->arg = (__u64)req_out;
	/* The remote agent's name is read at the return, and only where the request will
	 * not name it (the argument lives until then: the caller's reference). */
	c->arg2 = (__u64)remote_agent;
	store_call(CALL_CREATE_XFER_REQ, c);
	return 0;
}

/* A makeXferReq entered: its op, and the address of its `req` out-argument on the
 * stack (`req_at` bytes above the return address). */
static __always_inline int make_entered(struct pt_regs *ctx, void *self, __s32 op,
					__u64 req_at)
{
	note_agent((__u64)self);
	struct call_entry *c = new_call((__u64)self);
	if (!c)
		return 0;
	void *req_out = 0;
	bpf_probe_read_user(&req_out, sizeof(req_out), (const char *)PT_REGS_SP(ctx) + req_at);
	c->op = op;
	c->arg = (__u64)req_out;
	store_call(CALL_MAKE_XFER_REQ, c);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(make_xfer_enter, void *self, __s32 op)
{
	return make_entered(ctx, self, op, 24);
}

/* makeXferReq of builds before 1.5: the op by reference, req the seventh argument. */
SEC("uprobe")
int BPF_KPROBE(make_xfer_ref_enter, void *self, const __s32 *op)
{
	__s32 o = -1;
	bpf_probe_read_user(&o, sizeof(o), op);
	return make_entered(ctx, self, o, 8);
}

static __always_inline int xfer_created(__u32 call, __s32 status)
{
	struct call_entry c;
	if (take_call(call, &c) != 0)
		return 0;
	/* With the build's offsets every post reads what the request holds: user space
	 * needs to hear of a creation only when it failed. */
	if (status == 0 && offsets_known)
		return 0;
	struct nixl_event *e = event_reserve(EV_XFER_CREATE);
	if (!e)
		return 0;
	__u64 req = 0;
	if (c.arg)
		bpf_probe_read_user(&req, sizeof(req), (const void *)c.arg);
	e->call = call;
	e->agent = c.agent;
	e->status = status;
	e->req = e->status == 0 ? req : 0;
	e->latency_ns = e->ts_ns - c.ts_ns;
	e->op = c.op;
	e->flags |= c.flags;
	/* createXferReq names its remote agent in an argument; makeXferReq does not. */
	read_std_string(e->name, (const void *)c.arg2, &e->flags);
	event_submit(e);
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(create_xfer_exit)
{
	return xfer_created(CALL_CREATE_XFER_REQ, (__s32)PT_REGS_RC(ctx));
}

SEC("uretprobe")
int BPF_KRETPROBE(make_xfer_exit)
{
	return xfer_created(CALL_MAKE_XFER_REQ, (__s32)PT_REGS_RC(ctx));
}

/*
 * One of createXferReq's or makeXferReq's failure paths (sites: no entry probe, and
 * nothing on a successful creation, whose post reads the request). The cookie names
 * the method, the path's status, and where its op (and a create's remote agent) are:
 * the argument slots, or the request. makeXferReq names no remote agent (as its entry
 * and return probes do not).
 */
SEC("uprobe")
int BPF_KPROBE(xfer_creation_failed)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	int make = (cookie & FAILED_IN_MAKE) != 0;
	/* A path that fails before `this` reaches its usual place names the register. */
	__u64 agent_reg = (cookie >> FAILED_AGENT_SHIFT) & 0x1f;
	__u64 self = site_value(ctx, agent_reg ? (SRC_REG | (agent_reg - 1))
					       : make ? site_make_agent : site_create_agent);
	note_agent(self);
	struct nixl_event *e = event_reserve(EV_XFER_CREATE);
	if (!e)
		return 0;
	e->call = make ? CALL_MAKE_XFER_REQ : CALL_CREATE_XFER_REQ;
	e->agent = self;
	e->status = (__s32)site_value(ctx, cookie & (FAILED_REQUEST_BUILT - 1));
	__s32 op = -1;
	const char *remote = 0;
	if (cookie & FAILED_REQUEST_BUILT) {
		const char *req =
			(const char *)site_value(ctx, make ? site_make_request : site_create_request);
		if (req) {
			bpf_probe_read_user(&op, sizeof(op), req + off_req_op);
			if (!make)
				remote = req + off_req_remote;
		}
	} else {
		op = (__s32)site_value(ctx, make ? site_make_op : site_create_op);
		if (!make)
			remote = (const char *)site_value(ctx, site_create_remote_ref);
	}
	e->op = op;
	read_std_string(e->name, remote, &e->flags);
	event_submit(e);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(post_xfer_enter, void *self, void *req)
{
	note_agent((__u64)self);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 slot = (__u32)id & (POST_SLOTS - 1);
	struct post_entry *p = bpf_map_lookup_elem(&posts, &slot);
	if (!p)
		return 0;
	volatile __u64 *tag = &p->pid_tgid;
	if (*tag)
		count_lost();
	/* The tag first: a site that reads any field below also reads this tag again. */
	*tag = id;
	*(volatile __u64 *)&p->ts_ns = bpf_ktime_get_ns();
	*(volatile __u64 *)&p->agent = (__u64)self;
	*(volatile __u64 *)&p->req = (__u64)req;
	return 0;
}

/* Take this thread's post entry (see `posts`) into `out`: -1 when another thread's
 * entry replaced it (counted as lost at that entry) or none was stored. */
static __always_inline int take_post(struct post_entry *out)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 slot = (__u32)id & (POST_SLOTS - 1);
	struct post_entry *p = bpf_map_lookup_elem(&posts, &slot);
	if (!p)
		return -1;
	volatile __u64 *tag = &p->pid_tgid;
	if (*tag != id)
		return -1;
	out->ts_ns = *(volatile __u64 *)&p->ts_ns;
	out->agent = *(volatile __u64 *)&p->agent;
	out->req = *(volatile __u64 *)&p->req;
	/* An entry that began replacing it while these were read has written its tag
	 * first (x86 keeps stores, and loads, in order). */
	if (*tag != id)
		return -1;
	*tag = 0;
	return 0;
}

static __always_inline int xfer_posted(__s32 status)
{
	struct post_entry c;
	if (take_post(&c) != 0)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	const __u8 *w = read_req_window(c.req);
	struct inflight_entry x = {};
	x.ts_ns = c.ts_ns;
	read_req_info(&x, c.req, w, c.agent);
	int notif = w && w[win_at(off_req_has_notif)];
	/* With the build's offsets every transfer is counted here and its records are sent
	 * only when kept; without them user space counts them all from the records. */
	__u32 kept = FLAG_KEPT_SAMPLED;
	__u32 tallied = 0;
	if (offsets_known)
		kept = (notif ? FLAG_KEPT_NOTIF : 0) | sampled();
	if (status == NIXL_IN_PROG) {
		struct xfer_key k = {};
		k.pid = bpf_get_current_pid_tgid() >> 32;
		k.req = c.req;
		x.flags |= kept;
		/* Without its entry the transfer's end would count nowhere: said as lost. */
		if (bpf_map_update_elem(&inflight, &k, &x, BPF_ANY) != 0)
			count_lost();
		x.flags &= ~kept;
		/* Counted at its end: its record (if kept) is for the request join. */
		if (offsets_known)
			tallied = FLAG_TALLIED;
	} else if (offsets_known) {
		/* Ended at its post: done inline, or failed (no latency: nothing moved). */
		int done = status == 0;
		tallied = tally(done ? STAGE_COMPLETE : STAGE_POST, status, &x, now - c.ts_ns, done);
		kept = kept_at_end(kept, status, now - c.ts_ns, done);
	}
	if (!kept && tallied)
		return 0;
	/* The notification rides in the handle from create (or from post's own arguments,
	 * which post copies in before it returns). Sent first, so user space knows it when
	 * the post's record ends the transfer. */
	if (notif) {
		struct nixl_event *n = event_reserve(EV_XFER_NOTIF);
		if (n) {
			n->agent = c.agent;
			n->req = c.req;
			win_string(n->name, w, c.req, off_req_notif, &n->flags);
			event_submit(n);
		}
	}
	struct nixl_event *e = event_reserve(EV_XFER_POST);
	if (!e)
		return 0;
	e->req = c.req;
	e->status = status;
	e->latency_ns = e->ts_ns - c.ts_ns;
	fill_transfer(e, &x);
	if (tallied)
		e->flags |= tallied | kept;
	event_submit(e);
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(post_xfer_exit)
{
	return xfer_posted((__s32)PT_REGS_RC(ctx));
}

/* postXferReq's site: on every return path, its status in the frame. */
SEC("uprobe")
int BPF_KPROBE(post_xfer_returned)
{
	return xfer_posted((__s32)site_value(ctx, site_post_status));
}

/* A posted request's first terminal status: the end of its transfer. */
static __always_inline int xfer_done(__u64 req, __s32 status)
{
	struct xfer_key k = {};
	k.pid = bpf_get_current_pid_tgid() >> 32;
	k.req = req;
	struct inflight_entry *p = bpf_map_lookup_elem(&inflight, &k);
	if (!p)
		return 0;
	struct inflight_entry x = *p;
	/* The delete is the claim: of two probes ending the same transfer at once (a poll
	 * and a release on two threads), only the one that removes the entry counts it. */
	if (bpf_map_delete_elem(&inflight, &k) != 0)
		return 0;
	__u64 latency = bpf_ktime_get_ns() - x.ts_ns;
	__u32 kept = x.flags & (FLAG_KEPT_NOTIF | FLAG_KEPT_SAMPLED);
	x.flags &= ~kept;
	__u32 tallied = 0;
	if (offsets_known) {
		tallied = tally(STAGE_COMPLETE, status, &x, latency, 1);
		kept = kept_at_end(kept, status, latency, 1);
		if (!kept && tallied)
			return 0;
	}
	struct nixl_event *e = event_reserve(EV_XFER_DONE);
	if (!e)
		return 0;
	e->req = k.req;
	e->status = status;
	e->latency_ns = e->ts_ns - x.ts_ns;
	fill_transfer(e, &x);
	if (tallied)
		e->flags |= tallied | kept;
	event_submit(e);
	return 0;
}

/* getXferStatus' two sites: the backend has just reported the request done, or failed;
 * each path runs once per transfer. The status is in the request by then. */
static __always_inline __s32 req_status(__u64 req)
{
	__s32 status = NIXL_IN_PROG;
	if (req)
		bpf_probe_read_user(&status, sizeof(status), (const char *)req + off_req_status);
	return status;
}

SEC("uprobe")
int BPF_KPROBE(xfer_status_changed)
{
	__u64 req = site_value(ctx, site_done_req);
	return xfer_done(req, req_status(req));
}

/* getXferStatus' stale-remote site: the remote agent's metadata was invalidated or
 * replaced since the request was made; the call fails without touching the request's
 * status, which stays in progress. */
SEC("uprobe")
int BPF_KPROBE(xfer_status_stale)
{
	return xfer_done(site_value(ctx, site_done_req), (__s32)site_value(ctx, site_stale_status));
}

SEC("uprobe")
int BPF_KPROBE(xfer_status_enter, void *self, void *req)
{
	struct xfer_key k = {};
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	k.pid = pid_tgid >> 32;
	k.req = (__u64)req;
	if (!bpf_map_lookup_elem(&inflight, &k))
		return 0;
	__u64 r = (__u64)req;
	bpf_map_update_elem(&polling, &pid_tgid, &r, BPF_ANY);
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(xfer_status_exit)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u64 *req = bpf_map_lookup_elem(&polling, &pid_tgid);
	if (!req)
		return 0;
	struct xfer_key k = {};
	k.pid = pid_tgid >> 32;
	k.req = *req;
	bpf_map_delete_elem(&polling, &pid_tgid);
	__s32 status = (__s32)PT_REGS_RC(ctx);
	if (status == NIXL_IN_PROG)
		return 0;
	return xfer_done(k.req, status);
}

static __always_inline int xfer_released(__u64 agent, __u64 req)
{
	struct xfer_key k = {};
	k.pid = bpf_get_current_pid_tgid() >> 32;
	k.req = req;
	struct inflight_entry x = {};
	__u32 flags = 0;
	struct inflight_entry *p = bpf_map_lookup_elem(&inflight, &k);
	if (p)
		x = *p;
	/* Claimed by the delete, as at a transfer's end. */
	int claimed = p && bpf_map_delete_elem(&inflight, &k) == 0;
	if (claimed) {
		flags = FLAG_IN_FLIGHT;
		x.flags &= ~(FLAG_KEPT_NOTIF | FLAG_KEPT_SAMPLED);
		if (offsets_known && tally(STAGE_RELEASED_IN_FLIGHT, NIXL_IN_PROG, &x, 0, 0))
			flags |= FLAG_TALLIED | FLAG_KEPT_FAILURE;
	}
	struct nixl_event *e = event_reserve(EV_XFER_RELEASE);
	if (!e)
		return 0;
	if (claimed)
		fill_transfer(e, &x);
	if (agent)
		e->agent = agent;
	e->req = req;
	e->flags |= flags;
	event_submit(e);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(release_xfer_enter, void *self, void *req)
{
	return xfer_released((__u64)self, (__u64)req);
}

/* releaseXferReq's site: only on the path of a request still in progress. */
SEC("uprobe")
int BPF_KPROBE(xfer_released_in_flight)
{
	return xfer_released(0, site_value(ctx, site_release_req));
}
