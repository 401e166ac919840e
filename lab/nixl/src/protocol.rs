//! Commands the `run` coordinator gives a worker, and the worker's reply. The same types
//! serve in-process workers (direct calls) and worker processes (one JSON object per
//! line on stdin/stdout, each line prefixed with [`LINE_PREFIX`] so stray output from a
//! library cannot be mistaken for a reply).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::status::Injection;
use crate::truth::{
    HandshakeRecord, NotificationReceived, NotificationSent, Op, Phase, RegistrationRecord,
    TransferRecord,
};

/// Prefix of every protocol line on a worker process's stdin and stdout.
pub const LINE_PREFIX: &str = "@kvscope-nixl-lab ";

/// How a worker is set up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Agent name.
    pub name: String,
    /// Port for NIXL's metadata listener thread.
    pub listen_port: u16,
    /// Blocks in the pool.
    pub blocks: u32,
    /// Bytes per block.
    pub block_size: u32,
    /// Byte the pool is filled with.
    pub fill: u8,
    /// Listener thread poll delay (µs); NIXL's default is 100 000.
    pub listener_delay_us: u64,
    /// Progress thread pause between rounds (µs); nixl-sys's default is 0.
    pub progress_delay_us: u64,
}

/// A transfer to attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferSpec {
    /// READ (pull the remote's blocks) or WRITE (push ours).
    pub op: Op,
    /// Remote agent name passed to `createXferReq`.
    pub remote: String,
    /// Local block indices (READ: landing blocks; WRITE: source blocks).
    pub local_blocks: Vec<u32>,
    /// Remote pool address.
    pub remote_pool_addr: u64,
    /// Remote block indices.
    pub remote_blocks: Vec<u32>,
    /// Notification message to attach.
    pub notif: Option<String>,
    /// Failure to inject.
    pub inject: Option<Injection>,
    /// Make the request from prepared descriptor lists (`prepXferDlist` +
    /// `makeXferReq`, vLLM's path) instead of `createXferReq`.
    pub prepped: bool,
    /// For READs: the byte the landing blocks must hold afterwards.
    pub verify_fill: Option<u8>,
    /// Give up on an IN_PROG transfer after this long.
    pub timeout_ms: u64,
    /// With `inject = InvalidatedInFlight`: posts to try until one returns IN_PROG.
    pub max_attempts: u32,
    /// Phase to file the records under.
    pub phase: Phase,
}

/// A command for one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Report the agent (pid, pool address).
    Hello,
    /// `getLocalMD`: return this agent's metadata blob.
    GetLocalMd,
    /// `loadRemoteMD` of a blob (possibly mangled).
    LoadRemoteMd {
        /// The blob.
        blob: Vec<u8>,
        /// Whose blob it is (for the record).
        peer: String,
        /// Failure injected (corrupt metadata).
        inject: Option<Injection>,
        /// Phase.
        phase: Phase,
    },
    /// `fetchRemoteMD` from `127.0.0.1:port`, then poll `checkRemoteMD` until it arrives.
    FetchRemoteMd {
        /// Remote agent name.
        remote: String,
        /// Its listener port.
        port: u16,
        /// How long to wait for the metadata.
        wait_ms: u64,
        /// Failure injected (dead listener).
        inject: Option<Injection>,
    },
    /// `sendLocalMD` to the listener at `127.0.0.1:port` (the receiver awaits it).
    SendLocalMd {
        /// Receiving agent (for the record).
        to: String,
        /// Its listener port.
        port: u16,
    },
    /// Poll `checkRemoteMD` until `remote`'s metadata is loaded or `wait_ms` passes.
    AwaitRemoteMd {
        /// Remote agent name.
        remote: String,
        /// How long to wait.
        wait_ms: u64,
    },
    /// `makeConnection`.
    MakeConnection {
        /// Remote agent name.
        remote: String,
        /// Failure injected (unknown agent).
        inject: Option<Injection>,
        /// Phase.
        phase: Phase,
    },
    /// `invalidateRemoteMD`.
    InvalidateRemoteMd {
        /// Remote agent name.
        remote: String,
        /// Phase.
        phase: Phase,
    },
    /// Attempt a transfer.
    Transfer(TransferSpec),
    /// Check that landing blocks hold `fill`, then refill the pool with our own byte.
    Verify {
        /// Block indices.
        blocks: Vec<u32>,
        /// Expected byte.
        fill: u8,
    },
    /// `genNotif`.
    GenNotif {
        /// Receiving agent.
        to: String,
        /// Message.
        msg: String,
    },
    /// Call `getNotifs` until `expected` notifications arrived or `wait_ms` passed.
    CollectNotifs {
        /// How many to wait for.
        expected: u32,
        /// How long to wait.
        wait_ms: u64,
    },
    /// Publish these KV events (vLLM's format) on the worker's own KV event publisher:
    /// the blocks migrated to it, as its engine would announce them. Only a worker
    /// process started with a publisher (`worker --control`) takes it.
    Publish {
        /// The events, one batch.
        events: Vec<kvscope_wire::KvEvent>,
    },
    /// Invalidate every remote nixl-sys tracks, deregister the pool, destroy the agent.
    /// A worker process exits after replying.
    Shutdown,
}

impl Command {
    /// The command's tag, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Hello => "hello",
            Command::GetLocalMd => "get_local_md",
            Command::LoadRemoteMd { .. } => "load_remote_md",
            Command::FetchRemoteMd { .. } => "fetch_remote_md",
            Command::SendLocalMd { .. } => "send_local_md",
            Command::AwaitRemoteMd { .. } => "await_remote_md",
            Command::MakeConnection { .. } => "make_connection",
            Command::InvalidateRemoteMd { .. } => "invalidate_remote_md",
            Command::Transfer(_) => "transfer",
            Command::Verify { .. } => "verify",
            Command::GenNotif { .. } => "gen_notif",
            Command::CollectNotifs { .. } => "collect_notifs",
            Command::Publish { .. } => "publish",
            Command::Shutdown => "shutdown",
        }
    }
}

/// What the agent is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentInfo {
    /// Agent name.
    pub name: String,
    /// Process.
    pub pid: u32,
    /// Listener port.
    pub listen_port: u16,
    /// Pool address.
    pub pool_addr: u64,
    /// Blocks.
    pub blocks: u32,
    /// Bytes per block.
    pub block_size: u32,
    /// Fill byte.
    pub fill: u8,
}

/// A worker's reply: the records its NIXL calls produced, plus command-specific data.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    /// Transfer records (seq 0; the coordinator numbers them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub transfers: Vec<TransferRecord>,
    /// Handshake records.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handshakes: Vec<HandshakeRecord>,
    /// Notifications sent (genNotif and transfer-attached).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notifications_sent: Vec<NotificationSent>,
    /// Notifications received.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notifications_received: Vec<NotificationReceived>,
    /// Registrations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registrations: Vec<RegistrationRecord>,
    /// For `Hello`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentInfo>,
    /// For `GetLocalMd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob: Option<Vec<u8>>,
    /// For `Verify`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified: Option<bool>,
    /// For `AwaitRemoteMd`: (arrived, waited ns, checkRemoteMD calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival: Option<(bool, u64, u32)>,
    /// For `Shutdown`: calls per `nixlAgent` method over the agent's life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<BTreeMap<String, u64>>,
    /// A lab-level failure (not a NIXL status): the command could not be carried out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    /// A reply carrying only a lab-level error.
    pub fn failed(error: impl Into<String>) -> Self {
        Self {
            error: Some(error.into()),
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip_as_tagged_json() {
        let c = Command::MakeConnection {
            remote: "decode-1".into(),
            inject: Some(Injection::UnknownConnect),
            phase: Phase::Inject,
        };
        let line = serde_json::to_string(&c).unwrap();
        assert!(line.starts_with(r#"{"cmd":"make_connection""#), "{line}");
        assert_eq!(serde_json::from_str::<Command>(&line).unwrap(), c);
        let empty = serde_json::to_string(&Reply::default()).unwrap();
        assert_eq!(empty, "{}");
    }
}
