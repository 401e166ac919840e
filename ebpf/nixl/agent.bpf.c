/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Agent identity: nixlAgent::nixlAgent(const std::string &name, const nixlAgentConfig &)
 * gives the local agent's name for every later event of that `this`.
 */
#include "common.h"

SEC("uprobe")
int BPF_KPROBE(agent_ctor_enter, void *self, const void *name)
{
	struct call_entry *c = new_call((__u64)self);
	if (!c)
		return 0;
	c->name_len = read_std_string(c->name, name, &c->flags);
	store_call(CALL_AGENT_CTOR, c);
	return 0;
}

SEC("uretprobe")
int BPF_KRETPROBE(agent_ctor_exit)
{
	struct call_entry c;
	if (take_call(CALL_AGENT_CTOR, &c) != 0)
		return 0;
	struct agent_key k = {};
	k.pid = bpf_get_current_pid_tgid() >> 32;
	k.agent = c.agent;
	__u8 one = 1;
	bpf_map_update_elem(&agents, &k, &one, BPF_ANY);
	struct nixl_event *e = event_reserve(EV_AGENT_NEW);
	if (!e)
		return 0;
	e->agent = c.agent;
	e->call = CALL_AGENT_CTOR;
	e->latency_ns = e->ts_ns - c.ts_ns;
	e->flags |= c.flags;
	if (offsets_known) {
		__u64 data = 0;
		bpf_probe_read_user(&data, sizeof(data), (const char *)c.agent + off_agent_data);
		e->data = data;
	}
	__builtin_memcpy(e->name, c.name, NIXL_NAME_LEN);
	event_submit(e);
	return 0;
}
