//! Struct offsets of known `libnixl.so` builds, keyed by GNU build-id.
//!
//! The probes read a few fields of NIXL's C++ objects (the request handle's remote agent,
//! op and byte count; an agent's name; a registration list's lengths). Their offsets
//! change between NIXL versions, so they live here, one entry per build, and are handed
//! to the BPF programs as read-only globals before loading. For a build not listed the
//! probes dereference nothing: calls, statuses and latencies are still exact, but bytes,
//! ops of posted requests and remote names of handshakes without a name argument are
//! unknown — the agent says so once, with the build-id to add here.
//!
//! How an entry is found (1.5.1 wheel; ARCHITECTURE.md, "NIXL struct offsets"):
//! `nixlAgent::getXferTelemetry`
//! reads the request's status (0xb8) and telemetry block (0xc0..0xe8: totalBytes at
//! 0xd8, descCount at 0xe0); `nixlAgentData::agentName()` is `lea 0x8(%rdi)`; every
//! `nixlAgent` method starts with `mov (%rdi),%rax` (the data pointer at 0);
//! `registerMem` walks the descriptor vector at 0x10/0x18 of the list in strides of 0x38
//! adding the length at +8 of each; `postXferReq` copies its arguments' notification
//! into the request (`_M_assign` to 0x90) and sets `hasNotif` (`movb $0x1,0xb0`).

/// Offsets the probes need, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlOffsets {
    /// NIXL version the build belongs to (for messages).
    pub version: &'static str,
    /// `nixlAgent` → `nixlAgentData*` (`std::unique_ptr`).
    pub agent_data: u64,
    /// `nixlAgentData` → `std::string name`.
    pub data_name: u64,
    /// `nixlXferReqH` → `std::string remoteAgent`.
    pub req_remote: u64,
    /// `nixlXferReqH` → `nixl_xfer_op_t` (0 READ, 1 WRITE).
    pub req_op: u64,
    /// `nixlXferReqH` → telemetry `totalBytes`.
    pub req_bytes: u64,
    /// `nixlXferReqH` → telemetry `descCount`.
    pub req_descs: u64,
    /// `nixlXferReqH` → `nixl_blob_t notifMsg` (a `std::string`).
    pub req_notif: u64,
    /// `nixlXferReqH` → `bool hasNotif`.
    pub req_has_notif: u64,
    /// `nixlDescList` → descriptor vector's begin pointer (end follows).
    pub dlist_begin: u64,
    /// `sizeof(nixlBlobDesc)`.
    pub desc_stride: u64,
    /// `nixlBlobDesc` → `len`.
    pub desc_len: u64,
}

/// Known builds: (GNU build-id as hex, offsets).
pub const KNOWN_BUILDS: &[(&str, NixlOffsets)] = &[(
    // PyPI nixl-cu12==1.5.1, .nixl_cu12.mesonpy.libs/libnixl.so
    "c60ac851fdd67a4d9738b5b2f53bd4849505f241",
    NixlOffsets {
        version: "1.5.1 (PyPI nixl-cu12)",
        agent_data: 0x0,
        data_name: 0x8,
        req_remote: 0x60,
        req_op: 0xb4,
        req_bytes: 0xd8,
        req_descs: 0xe0,
        req_notif: 0x90,
        req_has_notif: 0xb0,
        dlist_begin: 0x10,
        desc_stride: 0x38,
        desc_len: 0x8,
    },
)];

/// The offsets of the build with this build-id, if known.
pub fn for_build(build_id: &str) -> Option<NixlOffsets> {
    KNOWN_BUILDS
        .iter()
        .find(|(id, _)| id.eq_ignore_ascii_case(build_id))
        .map(|(_, o)| *o)
}

impl NixlOffsets {
    /// The BPF globals (`const volatile` in `ebpf/nixl/common.h`) and their values.
    pub fn globals(offsets: Option<&NixlOffsets>) -> [(&'static str, u64); 12] {
        let o = offsets.copied().unwrap_or(NixlOffsets {
            version: "",
            agent_data: 0,
            data_name: 0,
            req_remote: 0,
            req_op: 0,
            req_bytes: 0,
            req_descs: 0,
            req_notif: 0,
            req_has_notif: 0,
            dlist_begin: 0,
            desc_stride: 0,
            desc_len: 0,
        });
        [
            ("offsets_known", u64::from(offsets.is_some())),
            ("off_agent_data", o.agent_data),
            ("off_data_name", o.data_name),
            ("off_req_remote", o.req_remote),
            ("off_req_op", o.req_op),
            ("off_req_bytes", o.req_bytes),
            ("off_req_descs", o.req_descs),
            ("off_req_notif", o.req_notif),
            ("off_req_has_notif", o.req_has_notif),
            ("off_dlist_begin", o.dlist_begin),
            ("desc_stride", o.desc_stride),
            ("off_desc_len", o.desc_len),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_global_is_declared_in_the_bpf_source() {
        let common = include_str!("../../../ebpf/nixl/common.h");
        for (name, _) in NixlOffsets::globals(None) {
            assert!(
                common.contains(&format!("const volatile __u64 {name} = 0;")),
                "{name} is not a global of ebpf/nixl/common.h"
            );
        }
    }

    #[test]
    fn lookup_by_build_id() {
        assert!(for_build("C60AC851FDD67A4D9738B5B2F53BD4849505F241").is_some());
        assert!(for_build("00").is_none());
        assert_eq!(NixlOffsets::globals(None)[0], ("offsets_known", 0));
    }
}
