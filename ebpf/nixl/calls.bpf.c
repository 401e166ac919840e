/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Metadata exchange (handshakes), notifications and memory registration: one entry and
 * one return program attached to each method, told apart by the uprobe cookie (a
 * `enum nixl_call`). Each reports the call's nixl_status_t, its latency and, where the
 * call carries it, the remote agent's name.
 *
 * Signatures (`this` in rdi):
 *   loadRemoteMD(const std::string &blob, std::string &agent_name)   name out in rdx
 *   nixlAgentData::loadRemoteMD(same)   also reached from the background thread that
 *                                       completes fetchRemoteMD; counted only there
 *   fetchRemoteMD(std::string remote, const nixl_opt_args_t *)       rsi (by value)
 *   sendLocalMD(const nixl_opt_args_t *)
 *   makeConnection(const std::string &remote, const nixl_opt_args_t *)       rsi
 *   checkRemoteMD(std::string remote, const nixl_xfer_dlist_t &)      rsi (by value)
 *   invalidateRemoteMD(const std::string &remote)                             rsi
 *   genNotif(const std::string &remote, const std::string &msg, ...)          rsi
 *   getNotifs(nixl_notifs_t &, const nixl_opt_args_t *)
 *   registerMem / deregisterMem(const nixl_reg_dlist_t &descs, ...)   rsi: bytes
 */
#include "common.h"

struct desc_sum {
	const char *begin;
	__u64 total;
};

static long add_desc_len(__u32 i, void *data)
{
	struct desc_sum *s = data;
	__u64 len = 0;
	bpf_probe_read_user(&len, sizeof(len), s->begin + (__u64)i * desc_stride + off_desc_len);
	s->total += len;
	return 0;
}

/* Sum the lengths of a registration descriptor list (needs the build's offsets): with
 * bpf_loop, up to MAX_SUMMED_DESCS descriptors (~100 ns each, once per registration);
 * a longer list's sum is of its first ones, flagged FLAG_BYTES_PARTIAL and counted. */
static __always_inline void sum_descs(struct call_entry *c, const void *dlist)
{
	if (!offsets_known || !dlist || !desc_stride)
		return;
	const char *begin = 0, *end = 0;
	bpf_probe_read_user(&begin, sizeof(begin), (const char *)dlist + off_dlist_begin);
	bpf_probe_read_user(&end, sizeof(end), (const char *)dlist + off_dlist_begin + 8);
	if (!begin || end <= begin)
		return;
	__u64 count = (__u64)(end - begin) / desc_stride;
	c->descs = (__u32)count;
	if (count > MAX_SUMMED_DESCS) {
		c->flags |= FLAG_BYTES_PARTIAL;
		count = MAX_SUMMED_DESCS;
	}
	struct desc_sum s = { .begin = begin, .total = 0 };
	bpf_loop((__u32)count, add_desc_len, &s, 0);
	c->bytes = s.total;
}

SEC("uprobe")
int BPF_KPROBE(call_enter, void *self, void *arg1, void *arg2)
{
	__u32 call = (__u32)bpf_get_attach_cookie(ctx);
	if (call == CALL_LOAD_REMOTE_MD_ASYNC) {
		/* Inside nixlAgent::loadRemoteMD on this thread: that probe reports it. */
		struct call_key k = call_key_of(CALL_LOAD_REMOTE_MD);
		if (bpf_map_lookup_elem(&calls, &k))
			return 0;
	} else {
		note_agent((__u64)self);
	}
	struct call_entry *c = new_call((__u64)self);
	if (!c)
		return 0;
	switch (call) {
	case CALL_LOAD_REMOTE_MD:
	case CALL_LOAD_REMOTE_MD_ASYNC:
		c->arg = (__u64)arg2; /* filled in by the call */
		break;
	case CALL_FETCH_REMOTE_MD:
	case CALL_MAKE_CONNECTION:
	case CALL_CHECK_REMOTE_MD:
	case CALL_INVALIDATE_REMOTE_MD:
	case CALL_GEN_NOTIF:
		c->name_len = read_std_string(c->name, arg1, &c->flags);
		break;
	case CALL_REGISTER_MEM:
	case CALL_DEREGISTER_MEM:
		sum_descs(c, arg1);
		break;
	default:
		break;
	}
	store_call(call, c);
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(call_exit)
{
	__u32 call = (__u32)bpf_get_attach_cookie(ctx);
	struct call_entry c;
	if (take_call(call, &c) != 0)
		return 0;
	struct nixl_event *e = event_reserve(EV_CALL);
	if (!e)
		return 0;
	e->call = call;
	e->agent = c.agent;
	e->status = (__s32)PT_REGS_RC(ctx);
	e->latency_ns = e->ts_ns - c.ts_ns;
	e->bytes = c.bytes;
	e->descs = c.descs;
	e->flags |= c.flags;
	if (call == CALL_LOAD_REMOTE_MD || call == CALL_LOAD_REMOTE_MD_ASYNC)
		read_std_string(e->name, (const void *)c.arg, &e->flags);
	else
		__builtin_memcpy(e->name, c.name, NIXL_NAME_LEN);
	event_submit(e);
	return 0;
}

/*
 * getXferTelemetry's refusal of an agent whose telemetry is off (a site the agent
 * derives from the library: the first instruction of the path that returns
 * NIXL_ERR_NO_TELEMETRY, with `this` still in rdi and the request in rsi). vLLM asks for
 * every transfer's telemetry and fails the transfer on this refusal, so a build or an
 * agent without telemetry fails them all while NIXL's own statuses say SUCCESS. No entry
 * is seen: no latency.
 */
SEC("uprobe")
int BPF_KPROBE(xfer_telemetry_refused, void *self, void *req)
{
	note_agent((__u64)self);
	struct nixl_event *e = event_reserve(EV_CALL);
	if (!e)
		return 0;
	e->call = CALL_GET_XFER_TELEMETRY;
	e->agent = (__u64)self;
	e->req = (__u64)req;
	e->status = NIXL_ERR_NO_TELEMETRY;
	if (offsets_known && req)
		read_std_string(e->name, (const char *)req + off_req_remote, &e->flags);
	event_submit(e);
	return 0;
}
