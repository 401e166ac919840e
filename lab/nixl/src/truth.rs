//! The lab's ground truth: every NIXL call the lab made that a `libnixl.so` uprobe can
//! see, what it returned, and totals. `kvscope-nixl-lab run` prints one [`Truth`] as
//! JSON; the eBPF tests read it back with serde and compare it with what the probes saw.
//!
//! Names follow NIXL: handshake calls are `loadRemoteMD`, `fetchRemoteMD`, … and the
//! per-method call counts are keyed by the `nixlAgent` method the `nixl-sys` call
//! reaches (see the crate README for the mapping).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::plan::RunConfig;
use crate::status::{Injection, StatusSeen};

/// Version of this JSON shape; bumped on incompatible changes.
pub const TRUTH_SCHEMA: u32 = 1;

/// Transfer direction, as `nixl_xfer_op_t` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Op {
    /// `NIXL_READ` (0): the initiator pulls the remote's blocks.
    #[serde(rename = "READ")]
    Read,
    /// `NIXL_WRITE` (1): the initiator pushes its blocks to the remote.
    #[serde(rename = "WRITE")]
    Write,
}

impl Op {
    /// The `nixl-sys` operation.
    pub fn xfer_op(self) -> nixl_sys::XferOp {
        match self {
            Op::Read => nixl_sys::XferOp::Read,
            Op::Write => nixl_sys::XferOp::Write,
        }
    }
}

/// How a transfer attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferOutcome {
    /// Completed: `postXferReq` returned NIXL_SUCCESS, or a later `getXferStatus` did.
    Done,
    /// `createXferReq` failed (no request handle; no post, poll or release follows).
    FailedAtCreate,
    /// `postXferReq` returned an error.
    FailedAtPost,
    /// `postXferReq` returned IN_PROG and a later `getXferStatus` returned an error.
    FailedAtCompletion,
    /// Still IN_PROG when the lab's deadline ran out (released anyway). Not expected.
    TimedOut,
}

/// The NIXL metadata / connection calls the lab makes, named as `nixlAgent` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum HandshakeCall {
    /// `nixlAgent::loadRemoteMD` (a peer's `getLocalMD` blob, passed out of band).
    #[serde(rename = "loadRemoteMD")]
    LoadRemoteMd,
    /// `nixlAgent::fetchRemoteMD` (socket: asks the peer's listener for its metadata).
    #[serde(rename = "fetchRemoteMD")]
    FetchRemoteMd,
    /// `nixlAgent::sendLocalMD` (socket: pushes this agent's metadata to a listener).
    #[serde(rename = "sendLocalMD")]
    SendLocalMd,
    /// `nixlAgent::makeConnection`.
    #[serde(rename = "makeConnection")]
    MakeConnection,
    /// `nixlAgent::checkRemoteMD` (the lab polls it to see async metadata arrive).
    #[serde(rename = "checkRemoteMD")]
    CheckRemoteMd,
    /// `nixlAgent::invalidateRemoteMD`.
    #[serde(rename = "invalidateRemoteMD")]
    InvalidateRemoteMd,
}

impl HandshakeCall {
    /// The `nixlAgent` method name.
    pub fn method(self) -> &'static str {
        match self {
            HandshakeCall::LoadRemoteMd => "loadRemoteMD",
            HandshakeCall::FetchRemoteMd => "fetchRemoteMD",
            HandshakeCall::SendLocalMd => "sendLocalMD",
            HandshakeCall::MakeConnection => "makeConnection",
            HandshakeCall::CheckRemoteMd => "checkRemoteMD",
            HandshakeCall::InvalidateRemoteMd => "invalidateRemoteMD",
        }
    }
}

/// Ok / error, judged on the native status (see [`StatusSeen::is_ok`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallOutcome {
    /// The `nixlAgent` call returned NIXL_SUCCESS (or IN_PROG).
    Ok,
    /// It returned an error.
    Error,
}

impl CallOutcome {
    /// From a status.
    pub fn of(status: &StatusSeen) -> Self {
        if status.is_ok() {
            CallOutcome::Ok
        } else {
            CallOutcome::Error
        }
    }
}

/// Which part of the run a call belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Metadata exchange and connections before any transfer.
    Handshake,
    /// `checkRemoteMD` polls waiting for socket-delivered metadata.
    Await,
    /// KV block migrations.
    Migrate,
    /// Failure injection (the injected call and the calls that set it up).
    Inject,
    /// Reloading metadata an injection invalidated.
    Restore,
    /// Shutting down: invalidating loaded remotes, deregistering memory.
    Teardown,
}

/// How the workers ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerMode {
    /// Every agent lives in the `run` process, driven from its main thread (NIXL adds a
    /// progress thread and a listener thread per agent).
    InProcess,
    /// One child process (`kvscope-nixl-lab worker`) per agent, driven over stdin/stdout.
    Processes,
}

/// The NIXL build the run used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NixlBuild {
    /// NIXL release (`1.5.1`).
    pub version: String,
    /// The `libnixl.so` file the agents mapped.
    pub libnixl: String,
    /// Its GNU build-id.
    pub build_id: Option<String>,
    /// The `nixl-sys` crate version.
    pub nixl_sys: String,
}

/// One emulated decode worker = one NIXL agent with a KV block pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentRecord {
    /// Agent name (`decode-0`, …; `decode-doomed` for the remote-gone target).
    pub name: String,
    /// Process that owns it.
    pub pid: u32,
    /// Port of its NIXL metadata listener (bound on 0.0.0.0 by NIXL; the lab talks to
    /// it on 127.0.0.1).
    pub listen_port: u16,
    /// Blocks in its pool.
    pub blocks: u32,
    /// Bytes per block.
    pub block_size: u32,
    /// Address of the pool (one DRAM registration of `blocks × block_size` bytes).
    pub pool_addr: u64,
    /// Byte the pool's source blocks are filled with (distinct per agent).
    pub fill: u8,
    /// True when the agent was destroyed before the end (the remote-gone injection).
    pub retired_early: bool,
    /// Calls this agent made, per `nixlAgent` method.
    pub calls: BTreeMap<String, u64>,
}

/// Metadata arriving asynchronously on a listener thread after `fetchRemoteMD` /
/// `sendLocalMD` (seen by a probe as `nixlAgentData::loadRemoteMD` on that thread).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AsyncLoad {
    /// The agent whose listener thread loads the metadata.
    pub loaded_by: String,
    /// Its process.
    pub pid: u32,
    /// Whether `checkRemoteMD` saw it arrive before the wait ran out.
    pub arrived: bool,
    /// From the call until `checkRemoteMD` first succeeded (or the wait ran out), ns.
    pub waited_ns: u64,
    /// `checkRemoteMD` calls made while waiting (each is also a handshake record).
    pub check_calls: u32,
}

/// One metadata / connection call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandshakeRecord {
    /// Order in the run (shared with transfers).
    pub seq: u64,
    /// Process that made the call.
    pub pid: u32,
    /// The call.
    pub call: HandshakeCall,
    /// The agent making it.
    pub local: String,
    /// The peer it concerns (for a corrupt blob: the agent whose blob was mangled).
    pub remote: Option<String>,
    /// Ok / error.
    pub outcome: CallOutcome,
    /// What it returned.
    pub status: StatusSeen,
    /// Wall-clock time inside the call, ns.
    pub wall_ns: u64,
    /// When it started (Unix epoch, ns).
    pub started_unix_ns: u64,
    /// Part of the run.
    pub phase: Phase,
    /// The failure injected, if any.
    pub injected: Option<Injection>,
    /// `ip:port` for the socket calls.
    pub peer_addr: Option<String>,
    /// For `fetchRemoteMD` / `sendLocalMD`: what happened on the listener side.
    pub async_load: Option<AsyncLoad>,
}

/// One transfer attempt: `createXferReq` → `postXferReq` → `getXferStatus`* →
/// `releaseXferReq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferRecord {
    /// Order in the run (shared with handshakes).
    pub seq: u64,
    /// Process that made the calls.
    pub pid: u32,
    /// Initiating agent.
    pub local: String,
    /// Remote agent named in `createXferReq` (or in the prepared remote list).
    pub remote: String,
    /// Made from prepared descriptor lists by `makeXferReq` instead of `createXferReq`.
    #[serde(default)]
    pub prepped: bool,
    /// READ or WRITE.
    pub op: Op,
    /// Descriptors per side (one per KV block; NIXL 1.5.1 does not merge them).
    pub descriptors: u32,
    /// Bytes to move (descriptors × block size).
    pub bytes: u64,
    /// How it ended.
    pub outcome: TransferOutcome,
    /// What the call that decided the outcome returned (`createXferReq` for
    /// failed_at_create, `postXferReq` for failed_at_post or a done-at-post, else the
    /// last `getXferStatus`).
    pub status: StatusSeen,
    /// The `nixlAgent` method that returned `status`.
    pub final_call: String,
    /// Whether `postXferReq` returned IN_PROG (None when not posted).
    pub post_in_progress: Option<bool>,
    /// `getXferStatus` calls made (the lab does not poll when the post completed).
    pub status_polls: u32,
    /// Wall clock from just before `postXferReq` to the call that returned NIXL_SUCCESS, ns.
    pub post_to_done_ns: Option<u64>,
    /// Wall clock from just before `postXferReq` to the call that returned the error, ns.
    pub post_to_failure_ns: Option<u64>,
    /// Notification message attached to the transfer.
    pub notif: Option<String>,
    /// The failure injected, if any.
    pub injected: Option<Injection>,
    /// For done transfers: whether the landing blocks hold the source's fill byte.
    pub data_verified: Option<bool>,
    /// Whether `releaseXferReq` was called (every created request is released).
    pub released: bool,
    /// When `createXferReq` was called (Unix epoch, ns).
    pub started_unix_ns: u64,
    /// For done transfers: whether `getXferTelemetry`, asked as vLLM asks for every
    /// finished transfer, refused with NIXL_ERR_NO_TELEMETRY (the agent's telemetry is
    /// off). None when not asked.
    #[serde(default)]
    pub telemetry_refused: Option<bool>,
}

/// How a notification was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NotifVia {
    /// Attached to a transfer (sent by the backend when the transfer completes).
    Xfer,
    /// `nixlAgent::genNotif`.
    #[serde(rename = "genNotif")]
    GenNotif,
}

/// A notification the lab sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotificationSent {
    /// Process of the sender.
    pub pid: u32,
    /// Sending agent.
    pub from: String,
    /// Receiving agent.
    pub to: String,
    /// Message.
    pub msg: String,
    /// Transfer-attached or genNotif.
    pub via: NotifVia,
    /// The transfer it rode on.
    pub transfer_seq: Option<u64>,
    /// For genNotif: what the call returned.
    pub status: Option<StatusSeen>,
    /// False when delivery is uncertain (the transfer failed after it was posted).
    pub certain: bool,
}

/// A notification an agent got from `getNotifs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotificationReceived {
    /// Process of the receiver.
    pub pid: u32,
    /// Receiving agent.
    pub agent: String,
    /// Sending agent.
    pub from: String,
    /// Message.
    pub msg: String,
}

/// Register or deregister.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegistrationOp {
    /// `nixlAgent::registerMem`.
    Register,
    /// `nixlAgent::deregisterMem`.
    Deregister,
}

/// One memory (de)registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrationRecord {
    /// Process.
    pub pid: u32,
    /// Agent.
    pub agent: String,
    /// Register or deregister.
    pub op: RegistrationOp,
    /// Bytes (one DRAM descriptor).
    pub bytes: u64,
    /// Start address.
    pub addr: u64,
    /// Whether nixl-sys reported success (deregistration does not report the status).
    pub ok: bool,
}

/// Notifications sent and received.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Notifications {
    /// Sent.
    pub sent: Vec<NotificationSent>,
    /// Received.
    pub received: Vec<NotificationReceived>,
}

/// Ok / error counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OkError {
    /// Calls that succeeded.
    pub ok: u64,
    /// Calls that failed.
    pub error: u64,
}

/// Totals over the records (recomputed and compared by [`Truth::check`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Summary {
    /// All transfer attempts.
    pub transfers_total: u64,
    /// Transfer attempts by op and outcome.
    pub transfers: BTreeMap<Op, BTreeMap<TransferOutcome, u64>>,
    /// Bytes moved by done transfers, by op.
    pub bytes_done: BTreeMap<Op, u64>,
    /// Descriptors of done transfers, by op.
    pub descriptors_done: BTreeMap<Op, u64>,
    /// Σ post→done wall clock of done transfers, by op (ns).
    pub post_to_done_ns_total: BTreeMap<Op, u64>,
    /// Handshake calls by call and outcome.
    pub handshakes: BTreeMap<HandshakeCall, OkError>,
    /// Socket metadata deliveries that arrived / never did.
    pub async_loads: OkError,
    /// Records (transfers and handshakes) per injected failure kind.
    pub injections: BTreeMap<Injection, u64>,
    /// Notifications sent (certain deliveries only).
    pub notifications_sent: u64,
    /// Notifications sent whose delivery is uncertain.
    pub notifications_sent_uncertain: u64,
    /// Notifications received.
    pub notifications_received: u64,
    /// Bytes registered.
    pub registered_bytes: u64,
    /// Bytes deregistered.
    pub deregistered_bytes: u64,
    /// `getXferStatus` calls.
    pub status_polls: u64,
    /// Done transfers whose data checked out / did not.
    pub data_verified: OkError,
    /// Calls per `nixlAgent` method, all agents.
    pub nixl_calls: BTreeMap<String, u64>,
    /// Calls per `nixlAgent` method, per process.
    pub nixl_calls_by_pid: BTreeMap<u32, BTreeMap<String, u64>>,
    /// Expected calls of internal functions a probe may also watch:
    /// `nixlAgentData::loadRemoteMD` (= `loadRemoteMD` calls + socket deliveries that
    /// arrived, the latter on listener threads) and `nixlAgentData::getLocalMD`
    /// (= `getLocalMD` + `sendLocalMD` calls + `fetchRemoteMD` requests a live listener
    /// answered).
    pub internal_calls: BTreeMap<String, u64>,
}

/// The whole ground truth of one run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Truth {
    /// [`TRUTH_SCHEMA`].
    pub schema: u32,
    /// Scenario name (`mixed`, `clean` or `custom`).
    pub scenario: String,
    /// In-process agents or one process per agent.
    pub mode: WorkerMode,
    /// Pid of the `run` process.
    pub run_pid: u32,
    /// The NIXL build used.
    pub nixl: NixlBuild,
    /// What was asked.
    pub config: RunConfig,
    /// Start of the run (Unix epoch, ns).
    pub started_unix_ns: u64,
    /// Duration of the run, ns.
    pub wall_ns: u64,
    /// The agents.
    pub agents: Vec<AgentRecord>,
    /// Metadata / connection calls in order.
    pub handshakes: Vec<HandshakeRecord>,
    /// Transfer attempts in order.
    pub transfers: Vec<TransferRecord>,
    /// Notifications.
    pub notifications: Notifications,
    /// Memory registrations.
    pub registrations: Vec<RegistrationRecord>,
    /// Totals.
    pub summary: Summary,
}

fn bump<K: Ord>(map: &mut BTreeMap<K, u64>, key: K, by: u64) {
    *map.entry(key).or_insert(0) += by;
}

impl Summary {
    /// Totals over the records of `t` (its `summary` field is ignored).
    pub fn compute(t: &Truth) -> Summary {
        let mut s = Summary::default();
        for x in &t.transfers {
            s.transfers_total += 1;
            bump(s.transfers.entry(x.op).or_default(), x.outcome, 1);
            s.status_polls += u64::from(x.status_polls);
            if x.outcome == TransferOutcome::Done {
                bump(&mut s.bytes_done, x.op, x.bytes);
                bump(&mut s.descriptors_done, x.op, u64::from(x.descriptors));
                bump(
                    &mut s.post_to_done_ns_total,
                    x.op,
                    x.post_to_done_ns.unwrap_or(0),
                );
            }
            if let Some(inj) = x.injected {
                bump(&mut s.injections, inj, 1);
            }
            match x.data_verified {
                Some(true) => s.data_verified.ok += 1,
                Some(false) => s.data_verified.error += 1,
                None => {}
            }
        }
        let mut async_arrived = 0u64;
        let mut fetch_answered = 0u64;
        for h in &t.handshakes {
            let e = s.handshakes.entry(h.call).or_default();
            match h.outcome {
                CallOutcome::Ok => e.ok += 1,
                CallOutcome::Error => e.error += 1,
            }
            // Injections are counted once per injected call (the call that fails, or
            // for dead listeners the fetch itself), not for setup/restore calls.
            if let Some(inj) = h.injected {
                bump(&mut s.injections, inj, 1);
            }
            if let Some(a) = &h.async_load {
                if a.arrived {
                    s.async_loads.ok += 1;
                    async_arrived += 1;
                    if h.call == HandshakeCall::FetchRemoteMd {
                        fetch_answered += 1;
                    }
                } else {
                    s.async_loads.error += 1;
                }
            }
        }
        for n in &t.notifications.sent {
            if n.certain {
                s.notifications_sent += 1;
            } else {
                s.notifications_sent_uncertain += 1;
            }
        }
        s.notifications_received = t.notifications.received.len() as u64;
        for r in &t.registrations {
            match r.op {
                RegistrationOp::Register => s.registered_bytes += r.bytes,
                RegistrationOp::Deregister => s.deregistered_bytes += r.bytes,
            }
        }
        for a in &t.agents {
            for (m, n) in &a.calls {
                bump(&mut s.nixl_calls, m.clone(), *n);
                bump(s.nixl_calls_by_pid.entry(a.pid).or_default(), m.clone(), *n);
            }
        }
        let calls = |m: &str| s.nixl_calls.get(m).copied().unwrap_or(0);
        s.internal_calls.insert(
            "nixlAgentData::loadRemoteMD".into(),
            calls("loadRemoteMD") + async_arrived,
        );
        s.internal_calls.insert(
            "nixlAgentData::getLocalMD".into(),
            calls("getLocalMD") + calls("sendLocalMD") + fetch_answered,
        );
        s
    }
}

impl Truth {
    /// Sets `summary` from the records.
    pub fn finish(&mut self) {
        self.summary = Summary::compute(self);
    }

    /// Self-consistency problems (empty when the truth adds up): the stored summary
    /// equals the recomputed one, and the per-method call counts agree with the records.
    pub fn check(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let s = Summary::compute(self);
        if s != self.summary {
            problems.push("summary differs from the totals of the records".to_string());
        }
        let calls = |m: &str| s.nixl_calls.get(m).copied().unwrap_or(0);
        let mut expect = |what: &str, want: u64| {
            let got = calls(what);
            if got != want {
                problems.push(format!(
                    "{what}: {got} calls counted by the agents, {want} in the records"
                ));
            }
        };
        let created = self
            .transfers
            .iter()
            .filter(|x| x.outcome != TransferOutcome::FailedAtCreate)
            .count() as u64;
        let prepped = self.transfers.iter().filter(|x| x.prepped).count() as u64;
        expect("createXferReq", self.transfers.len() as u64 - prepped);
        expect("makeXferReq", prepped);
        expect("postXferReq", created);
        expect(
            "releaseXferReq",
            self.transfers.iter().filter(|x| x.released).count() as u64,
        );
        expect("getXferStatus", s.status_polls);
        for call in [
            HandshakeCall::LoadRemoteMd,
            HandshakeCall::FetchRemoteMd,
            HandshakeCall::SendLocalMd,
            HandshakeCall::MakeConnection,
            HandshakeCall::CheckRemoteMd,
            HandshakeCall::InvalidateRemoteMd,
        ] {
            let n = s.handshakes.get(&call).map(|e| e.ok + e.error).unwrap_or(0);
            expect(call.method(), n);
        }
        expect(
            "genNotif",
            self.notifications
                .sent
                .iter()
                .filter(|n| n.via == NotifVia::GenNotif)
                .count() as u64,
        );
        let regs = |op| self.registrations.iter().filter(|r| r.op == op).count() as u64;
        expect("registerMem", regs(RegistrationOp::Register));
        expect("deregisterMem", regs(RegistrationOp::Deregister));
        if s.registered_bytes != s.deregistered_bytes {
            problems.push(format!(
                "registered {} bytes but deregistered {}",
                s.registered_bytes, s.deregistered_bytes
            ));
        }
        for x in &self.transfers {
            if x.outcome == TransferOutcome::FailedAtCreate
                && (x.released || x.post_in_progress.is_some())
            {
                problems.push(format!(
                    "transfer {} failed at create but was posted or released",
                    x.seq
                ));
            }
            if x.outcome != TransferOutcome::FailedAtCreate && !x.released {
                problems.push(format!("transfer {} was created but not released", x.seq));
            }
            if x.outcome == TransferOutcome::Done && x.post_to_done_ns.is_none() {
                problems.push(format!(
                    "transfer {} is done without a post→done time",
                    x.seq
                ));
            }
        }
        let pids: std::collections::BTreeSet<u32> = self.agents.iter().map(|a| a.pid).collect();
        for x in &self.transfers {
            if !pids.contains(&x.pid) {
                problems.push(format!("transfer {} has pid {} of no agent", x.seq, x.pid));
            }
        }
        problems
    }

    /// Count of transfers with this op and outcome.
    pub fn transfers_with(&self, op: Op, outcome: TransferOutcome) -> u64 {
        self.summary
            .transfers
            .get(&op)
            .and_then(|m| m.get(&outcome))
            .copied()
            .unwrap_or(0)
    }

    /// Count of failed handshake calls of this kind.
    pub fn handshake_errors(&self, call: HandshakeCall) -> u64 {
        self.summary
            .handshakes
            .get(&call)
            .map(|e| e.error)
            .unwrap_or(0)
    }

    /// Count of records injected with this failure.
    pub fn injected(&self, injection: Injection) -> u64 {
        self.summary
            .injections
            .get(&injection)
            .copied()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{native, StatusSeen};

    fn transfer(seq: u64, outcome: TransferOutcome, polls: u32) -> TransferRecord {
        let created = outcome != TransferOutcome::FailedAtCreate;
        TransferRecord {
            seq,
            pid: 7,
            local: "decode-1".into(),
            remote: "decode-0".into(),
            prepped: false,
            op: Op::Read,
            descriptors: 4,
            bytes: 4 * 4096,
            outcome,
            status: if outcome == TransferOutcome::Done {
                StatusSeen::ok()
            } else {
                StatusSeen::from_error(
                    &nixl_sys::NixlError::FailedToCreateXferRequest,
                    Some(native::ERR_NOT_FOUND),
                )
            },
            final_call: "postXferReq".into(),
            post_in_progress: created.then_some(polls > 0),
            status_polls: polls,
            post_to_done_ns: (outcome == TransferOutcome::Done).then_some(1000),
            post_to_failure_ns: None,
            notif: None,
            injected: (!created).then_some(Injection::UnknownRemote),
            data_verified: (outcome == TransferOutcome::Done).then_some(true),
            released: created,
            started_unix_ns: 0,
            telemetry_refused: None,
        }
    }

    fn sample() -> Truth {
        let calls: BTreeMap<String, u64> = [
            ("createXferReq", 2),
            ("postXferReq", 1),
            ("getXferStatus", 3),
            ("releaseXferReq", 1),
            ("loadRemoteMD", 1),
            ("registerMem", 1),
            ("deregisterMem", 1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut t = Truth {
            schema: TRUTH_SCHEMA,
            scenario: "test".into(),
            mode: WorkerMode::InProcess,
            run_pid: 7,
            nixl: NixlBuild {
                version: "1.5.1".into(),
                libnixl: "libnixl.so".into(),
                build_id: None,
                nixl_sys: "1.5.1".into(),
            },
            config: RunConfig::default(),
            started_unix_ns: 0,
            wall_ns: 1,
            agents: vec![AgentRecord {
                name: "decode-1".into(),
                pid: 7,
                listen_port: 1,
                blocks: 8,
                block_size: 4096,
                pool_addr: 0x1000,
                fill: 0x11,
                retired_early: false,
                calls,
            }],
            handshakes: vec![HandshakeRecord {
                seq: 1,
                pid: 7,
                call: HandshakeCall::LoadRemoteMd,
                local: "decode-1".into(),
                remote: Some("decode-0".into()),
                outcome: CallOutcome::Ok,
                status: StatusSeen::ok(),
                wall_ns: 10,
                started_unix_ns: 0,
                phase: Phase::Handshake,
                injected: None,
                peer_addr: None,
                async_load: None,
            }],
            transfers: vec![
                transfer(2, TransferOutcome::Done, 3),
                transfer(3, TransferOutcome::FailedAtCreate, 0),
            ],
            notifications: Notifications::default(),
            registrations: [RegistrationOp::Register, RegistrationOp::Deregister]
                .into_iter()
                .map(|op| RegistrationRecord {
                    pid: 7,
                    agent: "decode-1".into(),
                    op,
                    bytes: 8 * 4096,
                    addr: 0x1000,
                    ok: true,
                })
                .collect(),
            summary: Summary::default(),
        };
        t.finish();
        t
    }

    #[test]
    fn consistent_truth_checks_clean_and_sums_up() {
        let t = sample();
        assert_eq!(t.check(), Vec::<String>::new());
        assert_eq!(t.transfers_with(Op::Read, TransferOutcome::Done), 1);
        assert_eq!(
            t.transfers_with(Op::Read, TransferOutcome::FailedAtCreate),
            1
        );
        assert_eq!(t.summary.bytes_done[&Op::Read], 4 * 4096);
        assert_eq!(t.injected(Injection::UnknownRemote), 1);
        assert_eq!(t.summary.internal_calls["nixlAgentData::loadRemoteMD"], 1);
        // JSON round trip with the NIXL names
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains(r#""call":"loadRemoteMD""#) && json.contains(r#""op":"READ""#));
        assert_eq!(serde_json::from_str::<Truth>(&json).unwrap(), t);
    }

    #[test]
    fn miscounted_calls_and_stale_summaries_are_reported() {
        let mut t = sample();
        t.agents[0].calls.insert("getXferStatus".into(), 2);
        t.finish();
        let problems = t.check();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("getXferStatus"));

        let mut t = sample();
        t.transfers[0].bytes += 1;
        assert!(t.check().iter().any(|p| p.contains("summary")));
    }
}
