//! What the probes read of NIXL's C++ objects and where they find it, and one build's
//! offsets and completion sites read by hand, keyed by GNU build-id: the derivation's
//! fixture.
//!
//! The probes read a few fields of NIXL's C++ objects (the request handle's remote agent,
//! op and byte count; an agent's name; a registration list's lengths), handed to the BPF
//! programs as read-only globals before loading. Their offsets change between NIXL
//! versions: [`super::derive`] reads them from each library's instructions. The table
//! below holds the 1.5.1 wheel's offsets and completion sites as read by hand — the
//! derivation's fixture (`e2e/tests/e2e/agent/nixl_derive.rs`); nothing is attached
//! from it.
//!
//! How the 1.5.1 entry was read (ARCHITECTURE.md, "NIXL struct offsets"):
//! `nixlAgent::getXferTelemetry`
//! reads the request's status (0xb8) and telemetry block (0xc0..0xe8: totalBytes at
//! 0xd8, descCount at 0xe0); `nixlAgentData::agentName()` is `lea 0x8(%rdi)`; every
//! `nixlAgent` method starts with `mov (%rdi),%rax` (the data pointer at 0);
//! `registerMem` walks the descriptor vector at 0x10/0x18 of the list in strides of 0x38
//! adding the length at +8 of each; `postXferReq` copies its arguments' notification
//! into the request (`_M_assign` to 0x90) and sets `hasNotif` (`movb $0x1,0xb0`);
//! `getXferStatus` stores the backend's answer in the request's status (0xb8).
//!
//! A build's [`TransferSites`] are instructions inside the transfer methods where probes
//! see returns and transfer ends without firing on every status poll (ARCHITECTURE.md,
//! "Completion sites"); the agent derives them from each build.

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
    /// `nixlXferReqH` → `nixl_status_t status` (what `getXferStatus` returns once the
    /// transfer is done).
    pub req_status: u64,
    /// When the request's byte and descriptor counts hold the transfer's.
    pub counts: Counts,
    /// The build's completion sites as read by hand (the fixture's); None where derived.
    pub sites: Option<TransferSites>,
}

/// When a request's byte and descriptor counts hold its transfer's: where they do not,
/// a post says its bytes are unknown (counted, `FLAG_BYTES_UNKNOWN`) instead of reading
/// whatever the allocator left there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counts {
    /// Every request's (1.4 and later fill them on every creation).
    Always,
    /// Those made while the agent's telemetry is enabled (builds before 1.4 fill them
    /// only then; vLLM enables it): the flag is the byte at `data_flag` of the agent's
    /// `nixlAgentData`, read at each post.
    WithTelemetry { data_flag: u64 },
    /// None: bytes and descriptors are unknown.
    Never,
}

impl Counts {
    /// `req_counts_known` and `off_data_telemetry` of `ebpf/nixl/common.h`.
    fn globals(self) -> (u64, u64) {
        match self {
            Counts::Never => (0, 0),
            Counts::Always => (1, 0),
            Counts::WithTelemetry { data_flag } => (2, data_flag),
        }
    }
}

/// Where a completion site finds a value: a register, or a slot of the method's frame
/// (bytes below its frame pointer). The `SRC_*` encoding of `ebpf/nixl/common.h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteValue {
    Reg(SiteReg),
    Frame(u32),
    /// A 32-bit value whose address a frame slot holds (an argument passed by
    /// reference).
    FrameRef(u32),
    /// A 32-bit value whose address a register holds.
    RegRef(SiteReg),
    /// What the path returns without keeping it anywhere (a status).
    Const(i32),
}

/// The registers a site may read (`REG_*` in `ebpf/nixl/common.h`): the callee-saved
/// ones, which hold their values across calls, and the others, which a failure site
/// reached before any call may find an argument in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteReg {
    Rbx = 0,
    Rbp = 1,
    R12 = 2,
    R13 = 3,
    R14 = 4,
    R15 = 5,
    Rax = 6,
    Rcx = 7,
    Rdx = 8,
    Rsi = 9,
    Rdi = 10,
    R8 = 11,
    R9 = 12,
    R10 = 13,
    R11 = 14,
}

impl SiteValue {
    pub(crate) fn encoded(self) -> u64 {
        match self {
            Self::Reg(r) => (1 << 32) | r as u64,
            Self::Frame(off) => (2 << 32) | u64::from(off),
            Self::Const(v) => (3 << 32) | u64::from(v as u32),
            Self::FrameRef(off) => (4 << 32) | u64::from(off),
            Self::RegRef(r) => (5 << 32) | r as u64,
        }
    }
}

/// One instruction inside a NIXL method, for a probe that fires only when the method
/// takes the path through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeSite {
    /// Prefix of the method's mangled name, as in the probe table.
    pub symbol_prefix: &'static str,
    /// Bytes from the method's first instruction (negative: in the method's cold part,
    /// which the compiler placed before it).
    pub offset: i64,
    /// The instruction's bytes: checked in the file before attaching, so a wrong entry
    /// falls back to the status-call probes instead of probing the middle of another
    /// instruction.
    pub bytes: &'static [u8],
}

/// One path on which `createXferReq` or `makeXferReq` fails and returns, taken by no
/// successful call: where it starts (or sets its status), what it returns, and whether
/// the request handle was built by then (the op, and for a create the remote agent, are
/// read from it) or not (from the arguments' frame slots, [`CreationArgs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreationFailure {
    pub site: CodeSite,
    pub status: SiteValue,
    pub request_built: bool,
}

/// Where a creating method's arguments are on its failure paths: `this`, the op before
/// the request is built, the slot holding the address of the remote agent's name
/// (`createXferReq`'s argument; `makeXferReq` has none), and the register holding the
/// request once it is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreationArgs {
    pub agent: SiteValue,
    pub op: SiteValue,
    pub remote_ref: Option<SiteValue>,
    pub request: SiteValue,
}

/// Bits of a creation-failure probe's cookie (`common.h`): the request was built; the
/// method is `makeXferReq`.
pub(crate) const FAILED_REQUEST_BUILT: u64 = 1 << 40;
pub const FAILED_IN_MAKE: u64 = 1 << 41;
/// Bits 42–46 of that cookie: 1 + the register holding `this` on a path where it is not
/// in the method's usual place.
pub(crate) const FAILED_AGENT_SHIFT: u32 = 42;

impl CreationFailure {
    /// The uprobe cookie of this failure's probe: its status source, where its op and
    /// remote agent are, and which method it is in.
    pub fn cookie(&self, in_make: bool) -> u64 {
        failure_cookie(self.status, self.request_built, in_make, None)
    }
}

/// A creation-failure probe's cookie (`xfer_creation_failed` in `ebpf/nixl/xfer.bpf.c`):
/// the status's source, whether the request is built, the method, and the register
/// holding `this` where it is not in the method's usual place.
pub(crate) fn failure_cookie(
    status: SiteValue,
    request_built: bool,
    in_make: bool,
    agent: Option<SiteReg>,
) -> u64 {
    let mut c = status.encoded();
    if request_built {
        c |= FAILED_REQUEST_BUILT;
    }
    if in_make {
        c |= FAILED_IN_MAKE;
    }
    if let Some(r) = agent {
        c |= (r as u64 + 1) << FAILED_AGENT_SHIFT;
    }
    c
}

/// Where one build's transfers end, so that no probe fires on the busy-polled
/// `getXferStatus`, on a release of a finished transfer, or on a successful creation.
/// `createXferReq` and `makeXferReq` are seen only on the paths where they fail (a
/// successful creation is learned from its post, which reads the request). Every site
/// is derived from each build's own instructions (`derive::CreationSites`,
/// `derive::PostSite`, `derive::EndSites`); these are the fixture the derivation must
/// reproduce. All found by reading the methods'
/// disassembly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferSites {
    /// Every path on which `createXferReq` returns a failure.
    pub create_failed: &'static [CreationFailure],
    pub create_args: CreationArgs,
    /// Every path on which `makeXferReq` returns a failure.
    pub make_failed: &'static [CreationFailure],
    pub make_args: CreationArgs,
    pub post_returned: CodeSite,
    pub post_status: SiteValue,
    pub status_succeeded: CodeSite,
    pub status_failed: CodeSite,
    /// The path `getXferStatus` takes when the remote agent's metadata was invalidated
    /// or replaced since the request was made: it fails without storing its status.
    pub status_stale: CodeSite,
    pub stale_status: SiteValue,
    /// The request at the status sites.
    pub done_req: SiteValue,
    /// On the path of a release that finds its transfer still in progress.
    pub released_in_flight: CodeSite,
    pub release_req: SiteValue,
}

const CREATE: &str = "_ZNK9nixlAgent13createXferReqE";
const MAKE: &str = "_ZNK9nixlAgent11makeXferReqE14nixl_xfer_op_t";
const POST: &str = "_ZNK9nixlAgent11postXferReqE";
const STATUS: &str = "_ZNK9nixlAgent13getXferStatusE";
const RELEASE: &str = "_ZNK9nixlAgent14releaseXferReqE";

/// `lea -0xe0(%rbp),%rax`: the error log's message, a failure path's first instruction.
const LEA_MSG: [u8; 7] = [0x48, 0x8d, 0x85, 0x20, 0xff, 0xff, 0xff];
/// `mov -0x138(%rbp),%rdi`: the same, once the slot holds the message.
const MOV_MSG: [u8; 7] = [0x48, 0x8b, 0xbd, 0xc8, 0xfe, 0xff, 0xff];

/// `mov $-2,%ebx`.
const MOV_EBX_M2: [u8; 5] = [0xbb, 0xfe, 0xff, 0xff, 0xff];

const fn failed(
    symbol_prefix: &'static str,
    offset: i64,
    bytes: &'static [u8],
    status: SiteValue,
    request_built: bool,
) -> CreationFailure {
    CreationFailure {
        site: CodeSite {
            symbol_prefix,
            offset,
            bytes,
        },
        status,
        request_built,
    }
}

/// Builds read by hand: (GNU build-id as hex, offsets and sites). The derivation's
/// fixture, never attached from.
pub(crate) const KNOWN_BUILDS: &[(&str, NixlOffsets)] = &[(
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
        req_status: 0xb8,
        counts: Counts::Always,
        sites: Some(TransferSites {
            // Each failure's first instruction, in the method's cold part (the hot
            // branch's target); no successful call runs any of them. Before the request
            // is built the op and remote agent are read through the argument slots
            // (overwritten later on these paths by the error log's message); after, from
            // the request (%rbx).
            create_failed: &[
                // Descriptor counts differ (INVALID_PARAM).
                failed(
                    CREATE,
                    0x4ce3a - 0x63dc0,
                    &LEA_MSG,
                    SiteValue::Const(-2),
                    false,
                ),
                // A descriptor's lengths differ (INVALID_PARAM).
                failed(
                    CREATE,
                    0x4cf66 - 0x63dc0,
                    &LEA_MSG,
                    SiteValue::Const(-2),
                    false,
                ),
                // The remote agent is unknown, or was invalidated (NOT_FOUND).
                failed(
                    CREATE,
                    0x4d47f - 0x63dc0,
                    &LEA_MSG,
                    SiteValue::Const(-4),
                    false,
                ),
                // No backend for the local or remote memory type (NOT_FOUND).
                failed(
                    CREATE,
                    0x4d22c - 0x63dc0,
                    &LEA_MSG,
                    SiteValue::Const(-4),
                    false,
                ),
                // No backend in common (NOT_FOUND).
                failed(
                    CREATE,
                    0x4d554 - 0x63dc0,
                    &LEA_MSG,
                    SiteValue::Const(-4),
                    false,
                ),
                // No backend could populate both lists (NOT_FOUND).
                failed(
                    CREATE,
                    0x4d188 - 0x63dc0,
                    &MOV_MSG,
                    SiteValue::Const(-4),
                    true,
                ),
                // The backend does not support this transfer (NOT_SUPPORTED).
                failed(
                    CREATE,
                    0x4cff6 - 0x63dc0,
                    &MOV_MSG,
                    SiteValue::Const(-3),
                    true,
                ),
                // The backend's prepXfer failed: its status, in %r15 (`jmp` to the
                // cold part's error log).
                failed(
                    CREATE,
                    0x64677 - 0x63dc0,
                    &[0xe9, 0xe6, 0x8c, 0xfe, 0xff],
                    SiteValue::Reg(SiteReg::R15),
                    true,
                ),
            ],
            create_args: CreationArgs {
                agent: SiteValue::Reg(SiteReg::R12),
                op: SiteValue::FrameRef(0x138),
                remote_ref: Some(SiteValue::Frame(0x118)),
                request: SiteValue::Reg(SiteReg::Rbx),
            },
            // Each failing status's `mov $status,%ebx` in the cold part (several
            // branches share each), and the cold block the backend's failure jumps to.
            // The op (passed by value) stays at -0x198(%rbp) until the request is built
            // (%r12), `this` at -0x258(%rbp) throughout.
            make_failed: &[
                // Bad arguments or lists, no backend in the lists (INVALID_PARAM).
                failed(
                    MAKE,
                    0x4c378 - 0x62d80,
                    &MOV_EBX_M2,
                    SiteValue::Const(-2),
                    false,
                ),
                // The backend does not support the transfer (NOT_SUPPORTED).
                failed(
                    MAKE,
                    0x4c44d - 0x62d80,
                    &[0xbb, 0xfd, 0xff, 0xff, 0xff],
                    SiteValue::Const(-3),
                    false,
                ),
                // No backend in common (NOT_FOUND).
                failed(
                    MAKE,
                    0x4c7cb - 0x62d80,
                    &[0xbb, 0xfc, 0xff, 0xff, 0xff],
                    SiteValue::Const(-4),
                    false,
                ),
                // An index past its list's end (INVALID_PARAM).
                failed(
                    MAKE,
                    0x4c92a - 0x62d80,
                    &MOV_EBX_M2,
                    SiteValue::Const(-2),
                    true,
                ),
                // The backend's prepXfer failed: its status, in %ebx.
                failed(
                    MAKE,
                    0x4cb47 - 0x62d80,
                    &[0x48, 0x8d, 0x85, 0x40, 0xff, 0xff, 0xff],
                    SiteValue::Reg(SiteReg::Rbx),
                    true,
                ),
            ],
            make_args: CreationArgs {
                agent: SiteValue::Frame(0x258),
                op: SiteValue::Frame(0x198),
                remote_ref: None,
                request: SiteValue::Reg(SiteReg::R12),
            },
            // `je` after the tracer pops its correlation id; the status returned is
            // at -0xe8(%rbp) on every path (the null-request one included).
            post_returned: CodeSite {
                symbol_prefix: POST,
                offset: 0x36d,
                bytes: &[0x74, 0x0d],
            },
            post_status: SiteValue::Frame(0xe8),
            // After `checkXfer` stored 0 in the request: `test %rbp,%rbp; je`.
            status_succeeded: CodeSite {
                symbol_prefix: STATUS,
                offset: 0xbc,
                bytes: &[0x0f, 0x84, 0x96, 0x00, 0x00, 0x00],
            },
            // After it stored a negative status: `cmp $-10,%eax; jne`.
            status_failed: CodeSite {
                symbol_prefix: STATUS,
                offset: 0x19a,
                bytes: &[0x0f, 0x85, 0xfa, 0x8f, 0xfe, 0xff],
            },
            // The cold path both of its remote-section checks (none; expired) jump to,
            // returning NIXL_ERR_NOT_FOUND: `lea 0x20(%rsp),%rbp`, the request still in
            // %rbx.
            status_stale: CodeSite {
                symbol_prefix: STATUS,
                offset: 0x4dfaf - 0x64d50,
                bytes: &[0x48, 0x8d, 0x6c, 0x24, 0x20],
            },
            stale_status: SiteValue::Const(-4),
            done_req: SiteValue::Reg(SiteReg::Rbx),
            // `cmpl $1,0xb8(%rbx); jne` not taken: `mov (%rbx),%rdi`.
            released_in_flight: CodeSite {
                symbol_prefix: RELEASE,
                offset: 0x32,
                bytes: &[0x48, 0x8b, 0x3b],
            },
            release_req: SiteValue::Reg(SiteReg::Rbx),
        }),
    },
)];

/// The offsets of the build with this build-id, if known.
pub fn for_build(build_id: &str) -> Option<NixlOffsets> {
    KNOWN_BUILDS
        .iter()
        .find(|(id, _)| id.eq_ignore_ascii_case(build_id))
        .map(|(_, o)| *o)
}

/// Which completion sites a library's probes were attached at, for the globals their
/// programs read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SitesAttached {
    /// Where the derived creation sites find `createXferReq`'s and `makeXferReq`'s
    /// arguments.
    pub creations: Option<(CreationArgs, CreationArgs)>,
    /// Where the derived post site finds the status.
    pub post_status: Option<SiteValue>,
    /// The derived ends' registers and constant.
    pub ends: Option<EndRegisters>,
}

/// What the derived end sites' programs read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndRegisters {
    /// The request, at `getXferStatus`' sites.
    pub request: SiteReg,
    /// What `getXferStatus`' stale path returns.
    pub stale_status: i32,
    /// The request, at `releaseXferReq`'s in-flight site.
    pub release_request: SiteReg,
}

/// `REQ_WINDOW` of `ebpf/nixl/common.h`: a request's window is shorter.
pub(crate) const REQ_WINDOW: u64 = 256;

impl NixlOffsets {
    /// The span of the request a post reads in one read: (start, length). A
    /// `std::string` takes 32 bytes (pointer, length, and its inline characters).
    pub(crate) fn req_window(&self) -> (u64, u64) {
        let fields = [
            (self.req_remote, 32),
            (self.req_notif, 32),
            (self.req_has_notif, 1),
            (self.req_op, 4),
            (self.req_bytes, 8),
            (self.req_descs, 8),
        ];
        let start = fields.iter().map(|f| f.0).min().unwrap_or(0);
        let end = fields.iter().map(|f| f.0 + f.1).max().unwrap_or(0);
        (start, end - start)
    }

    /// The BPF globals (`const volatile` in `ebpf/nixl/common.h`) and their values;
    /// each group of sites' only where its probes were attached.
    pub(crate) fn globals(
        offsets: Option<&NixlOffsets>,
        attached: SitesAttached,
    ) -> [(&'static str, u64); 28] {
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
            req_status: 0,
            counts: Counts::Never,
            sites: None,
        });
        let window = offsets.map_or((0, 0), NixlOffsets::req_window);
        let (create, make) = attached.creations.unzip();
        let site = |args: Option<CreationArgs>, f: fn(&CreationArgs) -> SiteValue| {
            args.map_or(0, |a| f(&a).encoded())
        };
        let (done_req, stale_status, release_req) = attached.ends.map_or((0, 0, 0), |e| {
            (
                SiteValue::Reg(e.request).encoded(),
                SiteValue::Const(e.stale_status).encoded(),
                SiteValue::Reg(e.release_request).encoded(),
            )
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
            ("off_req_status", o.req_status),
            ("req_counts_known", o.counts.globals().0),
            ("off_data_telemetry", o.counts.globals().1),
            ("off_req_window", window.0),
            ("req_window_len", window.1),
            ("site_create_agent", site(create, |a| a.agent)),
            ("site_create_op", site(create, |a| a.op)),
            (
                "site_create_remote_ref",
                create
                    .and_then(|a| a.remote_ref)
                    .map_or(0, SiteValue::encoded),
            ),
            ("site_create_request", site(create, |a| a.request)),
            ("site_make_agent", site(make, |a| a.agent)),
            ("site_make_op", site(make, |a| a.op)),
            ("site_make_request", site(make, |a| a.request)),
            (
                "site_post_status",
                attached.post_status.map_or(0, SiteValue::encoded),
            ),
            ("site_done_req", done_req),
            ("site_stale_status", stale_status),
            ("site_release_req", release_req),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_global_is_declared_in_the_bpf_source() {
        let common = include_str!("../../../ebpf/nixl/common.h");
        for (name, _) in NixlOffsets::globals(None, SitesAttached::default()) {
            assert!(
                common.contains(&format!("const volatile __u64 {name} = 0;")),
                "{name} is not a global of ebpf/nixl/common.h"
            );
        }
    }

    #[test]
    fn site_values_are_encoded_as_the_bpf_source_decodes_them() {
        let common = include_str!("../../../ebpf/nixl/common.h");
        assert!(common.contains("#define SRC_REG (1ull << 32)"));
        assert!(common.contains("#define SRC_FRAME (2ull << 32)"));
        assert!(common.contains("#define SRC_CONST (3ull << 32)"));
        assert_eq!(SiteValue::Const(-4).encoded(), (3 << 32) | 0xffff_fffc);
        for (reg, name) in [
            (SiteReg::Rbx, "REG_RBX"),
            (SiteReg::Rbp, "REG_RBP"),
            (SiteReg::R12, "REG_R12"),
            (SiteReg::R13, "REG_R13"),
            (SiteReg::R14, "REG_R14"),
            (SiteReg::R15, "REG_R15"),
            (SiteReg::Rax, "REG_RAX"),
            (SiteReg::Rcx, "REG_RCX"),
            (SiteReg::Rdx, "REG_RDX"),
            (SiteReg::Rsi, "REG_RSI"),
            (SiteReg::Rdi, "REG_RDI"),
            (SiteReg::R8, "REG_R8"),
            (SiteReg::R9, "REG_R9"),
            (SiteReg::R10, "REG_R10"),
            (SiteReg::R11, "REG_R11"),
        ] {
            assert!(
                common.contains(&format!("#define {name} {}", reg as u64)),
                "{name}"
            );
            assert_eq!(SiteValue::Reg(reg).encoded(), (1 << 32) | reg as u64);
        }
        assert_eq!(SiteValue::Frame(0xe8).encoded(), (2 << 32) | 0xe8);
        assert!(common.contains("#define SRC_FRAME_REF (4ull << 32)"));
        assert!(common.contains("#define SRC_REG_REF (5ull << 32)"));
        assert_eq!(SiteValue::RegRef(SiteReg::R13).encoded(), (5 << 32) | 3);
        assert_eq!(SiteValue::FrameRef(0x138).encoded(), (4 << 32) | 0x138);
        // A creation failure's cookie: its status's source, and the bits for a built
        // request and for makeXferReq.
        assert!(common.contains("#define FAILED_REQUEST_BUILT (1ull << 40)"));
        assert!(common.contains("#define FAILED_IN_MAKE (1ull << 41)"));
        assert!(common.contains(&format!("#define FAILED_AGENT_SHIFT {FAILED_AGENT_SHIFT}")));
        let sites = KNOWN_BUILDS[0].1.sites.unwrap();
        for (failures, make) in [(sites.create_failed, false), (sites.make_failed, true)] {
            for f in failures {
                let c = f.cookie(make);
                assert_eq!(c & (FAILED_REQUEST_BUILT - 1), f.status.encoded());
                assert_eq!(c & FAILED_REQUEST_BUILT != 0, f.request_built);
                assert_eq!(c & FAILED_IN_MAKE != 0, make);
            }
        }
        // The sites' globals are zero unless the sites were attached.
        let o = KNOWN_BUILDS[0].1;
        let zero = NixlOffsets::globals(Some(&o), SitesAttached::default());
        let set = NixlOffsets::globals(
            Some(&o),
            SitesAttached {
                creations: Some((
                    KNOWN_BUILDS[0].1.sites.unwrap().create_args,
                    KNOWN_BUILDS[0].1.sites.unwrap().make_args,
                )),
                post_status: Some(SiteValue::Frame(0xe8)),
                ends: Some(EndRegisters {
                    request: SiteReg::Rbx,
                    stale_status: -4,
                    release_request: SiteReg::Rbx,
                }),
            },
        );
        for ((name, a), (_, b)) in zero.iter().zip(&set) {
            if name.starts_with("site_") {
                assert!(*a == 0 && *b != 0, "{name}");
            } else {
                assert_eq!(a, b, "{name}");
            }
        }
    }

    /// A post reads its request in one window: every field it reads lies inside it, and
    /// it is shorter than the BPF side's buffer bound.
    #[test]
    fn each_build_s_request_window_holds_the_fields_within_the_bpf_bound() {
        let common = include_str!("../../../ebpf/nixl/common.h");
        assert!(common.contains(&format!("#define REQ_WINDOW {REQ_WINDOW}")));
        for (_, o) in KNOWN_BUILDS {
            let (start, len) = o.req_window();
            assert!(len > 0 && len < REQ_WINDOW, "{len}");
            for (off, size) in [(o.req_remote, 32), (o.req_notif, 32), (o.req_op, 4)] {
                assert!(off >= start && off + size <= start + len);
            }
        }
        assert_eq!(KNOWN_BUILDS[0].1.req_window(), (0x60, 0x88));
        let g = NixlOffsets::globals(None, SitesAttached::default());
        assert!(g.contains(&("req_window_len", 0)));
    }

    #[test]
    fn lookup_by_build_id() {
        assert!(for_build("C60AC851FDD67A4D9738B5B2F53BD4849505F241").is_some());
        assert!(for_build("00").is_none());
        assert_eq!(
            NixlOffsets::globals(None, SitesAttached::default())[0],
            ("offsets_known", 0)
        );
    }
}
