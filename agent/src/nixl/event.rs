//! The records the NIXL probes send through the ring buffer (`struct nixl_event` in
//! `ebpf/nixl/nixl_event.h`), decoded from bytes without `unsafe`. A unit test reads
//! the C header and checks this layout and the enum values against it.

use std::fmt;

/// Length of the name buffer (`NIXL_NAME_LEN`).
pub(crate) const NAME_LEN: usize = 64;

/// What the probe saw (`enum nixl_event_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    AgentNew,
    AgentSeen,
    XferCreate,
    XferPost,
    XferDone,
    XferRelease,
    Call,
    /// The notification message of a posted request (just before its `XferPost`).
    XferNotif,
}

impl EventKind {
    fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::AgentNew,
            2 => Self::AgentSeen,
            3 => Self::XferCreate,
            4 => Self::XferPost,
            5 => Self::XferDone,
            6 => Self::XferRelease,
            7 => Self::Call,
            8 => Self::XferNotif,
            _ => return None,
        })
    }
}

/// The `nixlAgent` method behind an event (`enum nixl_call`; also the uprobe cookie).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NixlCall {
    LoadRemoteMd = 1,
    /// `nixlAgentData::loadRemoteMD` outside `nixlAgent::loadRemoteMD`: the background
    /// completion of a `fetchRemoteMD`.
    LoadRemoteMdAsync = 2,
    FetchRemoteMd = 3,
    SendLocalMd = 4,
    MakeConnection = 5,
    CheckRemoteMd = 6,
    InvalidateRemoteMd = 7,
    GenNotif = 8,
    GetNotifs = 9,
    RegisterMem = 10,
    DeregisterMem = 11,
    CreateXferReq = 12,
    MakeXferReq = 13,
    AgentCtor = 14,
    PostXferReq = 15,
    /// Only its refusals of an agent without telemetry (a derived site: no latency).
    GetXferTelemetry = 16,
}

impl NixlCall {
    pub const ALL: [NixlCall; 16] = [
        Self::LoadRemoteMd,
        Self::LoadRemoteMdAsync,
        Self::FetchRemoteMd,
        Self::SendLocalMd,
        Self::MakeConnection,
        Self::CheckRemoteMd,
        Self::InvalidateRemoteMd,
        Self::GenNotif,
        Self::GetNotifs,
        Self::RegisterMem,
        Self::DeregisterMem,
        Self::CreateXferReq,
        Self::MakeXferReq,
        Self::AgentCtor,
        Self::PostXferReq,
        Self::GetXferTelemetry,
    ];

    pub(crate) fn from_raw(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|c| *c as u32 == v)
    }

    /// The name NIXL gives the method (the `call` label).
    pub fn name(self) -> &'static str {
        match self {
            Self::LoadRemoteMd => "loadRemoteMD",
            Self::LoadRemoteMdAsync => "loadRemoteMD_async",
            Self::FetchRemoteMd => "fetchRemoteMD",
            Self::SendLocalMd => "sendLocalMD",
            Self::MakeConnection => "makeConnection",
            Self::CheckRemoteMd => "checkRemoteMD",
            Self::InvalidateRemoteMd => "invalidateRemoteMD",
            Self::GenNotif => "genNotif",
            Self::GetNotifs => "getNotifs",
            Self::RegisterMem => "registerMem",
            Self::DeregisterMem => "deregisterMem",
            Self::CreateXferReq => "createXferReq",
            Self::MakeXferReq => "makeXferReq",
            Self::AgentCtor => "nixlAgent",
            Self::PostXferReq => "postXferReq",
            Self::GetXferTelemetry => "getXferTelemetry",
        }
    }
}

/// `nixl_status_t` as a label. A code this list does not name (one a newer NIXL added)
/// keeps its number (`ERR_CODE_13` for -13), so no two statuses share a series.
pub fn status_name(status: i32) -> std::borrow::Cow<'static, str> {
    std::borrow::Cow::Borrowed(match status {
        1 => "IN_PROG",
        0 => "SUCCESS",
        -1 => "ERR_NOT_POSTED",
        -2 => "ERR_INVALID_PARAM",
        -3 => "ERR_BACKEND",
        -4 => "ERR_NOT_FOUND",
        -5 => "ERR_MISMATCH",
        -6 => "ERR_NOT_ALLOWED",
        -7 => "ERR_REPOST_ACTIVE",
        -8 => "ERR_UNKNOWN",
        -9 => "ERR_NOT_SUPPORTED",
        -10 => "ERR_REMOTE_DISCONNECT",
        -11 => "ERR_CANCELED",
        -12 => "ERR_NO_TELEMETRY",
        s if s < 0 => return format!("ERR_CODE_{}", s.unsigned_abs()).into(),
        s => return format!("STATUS_{s}").into(),
    })
}

/// `flags` bits.
pub mod flags {
    pub(crate) const OFFSETS_KNOWN: u32 = 1 << 0;
    pub(crate) const NAME_TRUNCATED: u32 = 1 << 1;
    pub(crate) const IN_FLIGHT: u32 = 1 << 2;
    pub(crate) const BYTES_PARTIAL: u32 = 1 << 3;
    /// A post whose request holds no byte count the probes could read.
    pub(crate) const BYTES_UNKNOWN: u32 = 1 << 4;
    /// Counted in the kernel's tallies: the record is for spans and the request join.
    pub(crate) const TALLIED: u32 = 1 << 5;
    pub(crate) const KEPT_FAILURE: u32 = 1 << 6;
    pub(crate) const KEPT_NOTIF: u32 = 1 << 7;
    pub(crate) const KEPT_SLOW: u32 = 1 << 8;
    pub(crate) const KEPT_SAMPLED: u32 = 1 << 9;
    /// Why a tallied transfer's record was sent: any of these.
    pub(crate) const KEPT: u32 = KEPT_FAILURE | KEPT_NOTIF | KEPT_SLOW | KEPT_SAMPLED;
}

/// One decoded `struct nixl_event`.
#[derive(Clone, PartialEq, Eq)]
pub struct NixlEvent {
    pub kind: EventKind,
    pub pid: u32,
    pub tid: u32,
    pub status: i32,
    pub ts_ns: u64,
    pub latency_ns: u64,
    pub agent: u64,
    pub data: u64,
    pub req: u64,
    pub bytes: u64,
    pub descs: u32,
    /// 0 READ, 1 WRITE, negative: unknown.
    pub op: i32,
    pub call: Option<NixlCall>,
    pub flags: u32,
    pub name: String,
}

impl fmt::Debug for NixlEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} pid={} call={:?} status={} req={:#x} agent={:#x} op={} bytes={} lat={}ns name={:?}",
            self.kind,
            self.pid,
            self.call,
            self.status,
            self.req,
            self.agent,
            self.op,
            self.bytes,
            self.latency_ns,
            self.name
        )
    }
}

/// Why a ring buffer record could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("a NIXL probe record of {0} bytes, expected {SIZE}: agent and BPF object differ")]
    Size(usize),
    #[error("unknown NIXL probe record kind {0}")]
    Kind(u32),
}

/// `sizeof(struct nixl_event)`.
pub(crate) const SIZE: usize = 80 + NAME_LEN;

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(a)
}

impl NixlEvent {
    /// Decode one ring buffer record.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < SIZE {
            return Err(DecodeError::Size(b.len()));
        }
        let raw_kind = u32_at(b, 0);
        let kind = EventKind::from_raw(raw_kind).ok_or(DecodeError::Kind(raw_kind))?;
        let name_bytes = &b[80..80 + NAME_LEN];
        let end = name_bytes.iter().position(|&c| c == 0).unwrap_or(NAME_LEN);
        Ok(Self {
            kind,
            pid: u32_at(b, 4),
            tid: u32_at(b, 8),
            status: u32_at(b, 12) as i32,
            ts_ns: u64_at(b, 16),
            latency_ns: u64_at(b, 24),
            agent: u64_at(b, 32),
            data: u64_at(b, 40),
            req: u64_at(b, 48),
            bytes: u64_at(b, 56),
            descs: u32_at(b, 64),
            op: u32_at(b, 68) as i32,
            call: NixlCall::from_raw(u32_at(b, 72)),
            flags: u32_at(b, 76),
            name: String::from_utf8_lossy(&name_bytes[..end]).into_owned(),
        })
    }

    /// Encode (tests: build records as the probes would).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SIZE];
        let kind = match self.kind {
            EventKind::AgentNew => 1u32,
            EventKind::AgentSeen => 2,
            EventKind::XferCreate => 3,
            EventKind::XferPost => 4,
            EventKind::XferDone => 5,
            EventKind::XferRelease => 6,
            EventKind::Call => 7,
            EventKind::XferNotif => 8,
        };
        b[0..4].copy_from_slice(&kind.to_ne_bytes());
        b[4..8].copy_from_slice(&self.pid.to_ne_bytes());
        b[8..12].copy_from_slice(&self.tid.to_ne_bytes());
        b[12..16].copy_from_slice(&self.status.to_ne_bytes());
        b[16..24].copy_from_slice(&self.ts_ns.to_ne_bytes());
        b[24..32].copy_from_slice(&self.latency_ns.to_ne_bytes());
        b[32..40].copy_from_slice(&self.agent.to_ne_bytes());
        b[40..48].copy_from_slice(&self.data.to_ne_bytes());
        b[48..56].copy_from_slice(&self.req.to_ne_bytes());
        b[56..64].copy_from_slice(&self.bytes.to_ne_bytes());
        b[64..68].copy_from_slice(&self.descs.to_ne_bytes());
        b[68..72].copy_from_slice(&self.op.to_ne_bytes());
        b[72..76].copy_from_slice(&self.call.map(|c| c as u32).unwrap_or(0).to_ne_bytes());
        b[76..80].copy_from_slice(&self.flags.to_ne_bytes());
        let n = self.name.len().min(NAME_LEN - 1);
        b[80..80 + n].copy_from_slice(&self.name.as_bytes()[..n]);
        b
    }

    /// A blank event of `kind` (tests).
    pub fn blank(kind: EventKind) -> Self {
        Self {
            kind,
            pid: 0,
            tid: 0,
            status: 0,
            ts_ns: 0,
            latency_ns: 0,
            agent: 0,
            data: 0,
            req: 0,
            bytes: 0,
            descs: 0,
            op: -1,
            call: None,
            flags: 0,
            name: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = include_str!("../../../ebpf/nixl/nixl_event.h");

    /// The C layout of `struct nixl_event` from the header: (field, offset, size).
    fn c_layout() -> Vec<(String, usize, usize)> {
        let body = HEADER
            .split("struct nixl_event {")
            .nth(1)
            .and_then(|s| s.split("};").next())
            .expect("struct nixl_event in the header");
        let mut out = Vec::new();
        let mut at = 0usize;
        for line in body.lines() {
            let line = line.split("/*").next().unwrap().trim();
            let Some(decl) = line.strip_suffix(';') else {
                continue;
            };
            let mut parts = decl.split_whitespace();
            let ty = parts.next().unwrap();
            let name = parts.next().unwrap();
            let (size, align, name) = match ty {
                "__u32" | "__s32" => (4, 4, name.to_string()),
                "__u64" | "__s64" => (8, 8, name.to_string()),
                "char" => {
                    assert_eq!(name, "name[NIXL_NAME_LEN]");
                    (NAME_LEN, 1, "name".to_string())
                }
                other => panic!("unexpected type {other} in struct nixl_event"),
            };
            at = at.div_ceil(align) * align;
            out.push((name, at, size));
            at += size;
        }
        out
    }

    fn enum_value(name: &str) -> u32 {
        let line = HEADER
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} =")))
            .unwrap_or_else(|| panic!("{name} in the header"));
        line.split('=')
            .nth(1)
            .unwrap()
            .split(',')
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn the_layout_matches_the_c_header() {
        let layout = c_layout();
        let expected = [
            ("kind", 0, 4),
            ("pid", 4, 4),
            ("tid", 8, 4),
            ("status", 12, 4),
            ("ts_ns", 16, 8),
            ("latency_ns", 24, 8),
            ("agent", 32, 8),
            ("data", 40, 8),
            ("req", 48, 8),
            ("bytes", 56, 8),
            ("descs", 64, 4),
            ("op", 68, 4),
            ("call", 72, 4),
            ("flags", 76, 4),
            ("name", 80, NAME_LEN),
        ];
        let got: Vec<(&str, usize, usize)> = layout
            .iter()
            .map(|(n, o, s)| (n.as_str(), *o, *s))
            .collect();
        assert_eq!(got, expected);
        let (_, last, size) = layout.last().unwrap();
        assert_eq!(last + size, SIZE);
        assert!(HEADER.contains(&format!("#define NIXL_NAME_LEN {NAME_LEN}")));
    }

    #[test]
    fn enum_values_match_the_c_header() {
        for (c, name) in [
            (NixlCall::LoadRemoteMd, "CALL_LOAD_REMOTE_MD"),
            (NixlCall::LoadRemoteMdAsync, "CALL_LOAD_REMOTE_MD_ASYNC"),
            (NixlCall::FetchRemoteMd, "CALL_FETCH_REMOTE_MD"),
            (NixlCall::SendLocalMd, "CALL_SEND_LOCAL_MD"),
            (NixlCall::MakeConnection, "CALL_MAKE_CONNECTION"),
            (NixlCall::CheckRemoteMd, "CALL_CHECK_REMOTE_MD"),
            (NixlCall::InvalidateRemoteMd, "CALL_INVALIDATE_REMOTE_MD"),
            (NixlCall::GenNotif, "CALL_GEN_NOTIF"),
            (NixlCall::GetNotifs, "CALL_GET_NOTIFS"),
            (NixlCall::RegisterMem, "CALL_REGISTER_MEM"),
            (NixlCall::DeregisterMem, "CALL_DEREGISTER_MEM"),
            (NixlCall::CreateXferReq, "CALL_CREATE_XFER_REQ"),
            (NixlCall::MakeXferReq, "CALL_MAKE_XFER_REQ"),
            (NixlCall::AgentCtor, "CALL_AGENT_CTOR"),
            (NixlCall::PostXferReq, "CALL_POST_XFER_REQ"),
            (NixlCall::GetXferTelemetry, "CALL_GET_XFER_TELEMETRY"),
        ] {
            assert_eq!(c as u32, enum_value(name), "{name}");
        }
        for (k, name) in [
            (EventKind::AgentNew, "EV_AGENT_NEW"),
            (EventKind::AgentSeen, "EV_AGENT_SEEN"),
            (EventKind::XferCreate, "EV_XFER_CREATE"),
            (EventKind::XferPost, "EV_XFER_POST"),
            (EventKind::XferDone, "EV_XFER_DONE"),
            (EventKind::XferRelease, "EV_XFER_RELEASE"),
            (EventKind::Call, "EV_CALL"),
            (EventKind::XferNotif, "EV_XFER_NOTIF"),
        ] {
            assert_eq!(EventKind::from_raw(enum_value(name)), Some(k), "{name}");
        }
        for (bit, name) in [
            (flags::OFFSETS_KNOWN, "FLAG_OFFSETS_KNOWN"),
            (flags::NAME_TRUNCATED, "FLAG_NAME_TRUNCATED"),
            (flags::IN_FLIGHT, "FLAG_IN_FLIGHT"),
            (flags::BYTES_PARTIAL, "FLAG_BYTES_PARTIAL"),
            (flags::BYTES_UNKNOWN, "FLAG_BYTES_UNKNOWN"),
        ] {
            let shift = bit.trailing_zeros();
            assert!(
                HEADER.contains(&format!("#define {name} (1u << {shift})")),
                "{name}"
            );
        }
    }

    #[test]
    fn statuses_a_newer_nixl_added_keep_their_code() {
        assert_eq!(status_name(-4), "ERR_NOT_FOUND");
        assert_eq!(status_name(-12), "ERR_NO_TELEMETRY");
        assert_eq!(status_name(-13), "ERR_CODE_13");
        assert_eq!(status_name(-14), "ERR_CODE_14");
        assert_eq!(status_name(2), "STATUS_2");
        assert_eq!(status_name(i32::MIN), "ERR_CODE_2147483648");
    }

    #[test]
    fn the_handshake_calls_the_collector_counts_are_calls_the_probes_name() {
        for name in kvscope_wire::nixl::HANDSHAKE_CALLS {
            assert!(
                NixlCall::ALL.iter().any(|c| c.name() == name),
                "{name} is not a probed call"
            );
        }
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let mut e = NixlEvent::blank(EventKind::XferPost);
        e.pid = 42;
        e.status = -5;
        e.req = 0xdead_beef;
        e.bytes = 65536;
        e.op = 1;
        e.call = Some(NixlCall::PostXferReq);
        e.name = "decode-1".into();
        let b = e.encode();
        assert_eq!(NixlEvent::decode(&b).unwrap(), e);
        assert_eq!(NixlEvent::decode(&b[..10]), Err(DecodeError::Size(10)));
        let mut bad = b.clone();
        bad[0] = 99;
        assert_eq!(NixlEvent::decode(&bad), Err(DecodeError::Kind(99)));
    }
}
