//! One emulated decode worker: a NIXL agent (UCX backend, progress thread, metadata
//! listener thread) with a KV block pool registered as DRAM. It carries out
//! [`Command`]s and reports every `nixlAgent` call it made as records.
//!
//! Every NIXL call goes through `nixl-sys`'s safe API; each is counted under the
//! `nixlAgent` method it reaches (see the crate README). Calls `nixl-sys` makes on its
//! own are avoided or accounted for: a transfer request is released when its
//! `XferRequest` drops, the pool is deregistered explicitly (not by a `Drop`), and every
//! remote `nixl-sys` tracks is invalidated before the agent is destroyed (its `Drop`
//! would otherwise call `invalidateRemoteMD` unseen).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, NixlError, NotificationMap, OptArgs, RegistrationHandle,
    SystemStorage, XferDescList, XferStatus,
};
use tracing::{debug, warn};

use crate::protocol::{AgentInfo, Command, Reply, TransferSpec, WorkerSpec, LINE_PREFIX};
use crate::status::{native_for_injection, Injection, StatusSeen};
use crate::truth::{
    AsyncLoad, CallOutcome, HandshakeCall, HandshakeRecord, NotifVia, NotificationReceived,
    NotificationSent, Op, Phase, RegistrationOp, RegistrationRecord, TransferOutcome,
    TransferRecord,
};

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// `libnixl_capi.so` could not be loaded (the environment lacks the wheel's libs).
    #[error(
        "libnixl_capi.so is not loadable in this process: start it with LD_LIBRARY_PATH \
         and NIXL_PLUGIN_DIR from `kvscope-nixl-lab env`"
    )]
    CapiMissing,
    /// A NIXL call during set-up failed.
    #[error("{what} failed for agent {agent}: {source}")]
    Nixl {
        /// The step.
        what: &'static str,
        /// The agent.
        agent: String,
        /// The nixl-sys error.
        source: NixlError,
    },
}

/// Now, as ns since the Unix epoch.
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn elapsed_ns(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// One agent and its pool.
pub struct Worker {
    spec: WorkerSpec,
    pid: u32,
    agent: Option<Agent>,
    pool: SystemStorage,
    pool_addr: u64,
    registration: Option<RegistrationHandle>,
    /// Mirror of nixl-sys's own set of remotes (filled by `load_remote_md` and
    /// `fetch_remote_md`, emptied by `invalidate_remote_md`): the only names its
    /// `invalidate_remote_md` passes on to NIXL, and the ones its `Drop` invalidates.
    sys_remotes: BTreeSet<String>,
    /// Remotes whose metadata the lab knows is loaded in this agent.
    loaded: BTreeSet<String>,
    calls: BTreeMap<String, u64>,
    next_seq: u64,
    pending_registrations: Vec<RegistrationRecord>,
}

impl Worker {
    /// Creates the agent (UCX backend, listener on `spec.listen_port`), allocates the
    /// pool, fills it with `spec.fill` and registers it.
    pub fn new(spec: WorkerSpec) -> Result<Self, WorkerError> {
        if nixl_sys::is_stub() {
            return Err(WorkerError::CapiMissing);
        }
        let nixl = |what: &'static str| {
            let agent = spec.name.clone();
            move |source| WorkerError::Nixl {
                what,
                agent,
                source,
            }
        };
        let config = AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: true,
            listen_port: i32::from(spec.listen_port),
            lthr_delay_us: spec.listener_delay_us,
            pthr_delay_us: spec.progress_delay_us,
            ..AgentConfig::default()
        };
        let agent =
            Agent::new_configured(&spec.name, &config).map_err(nixl("creating the agent"))?;
        let mut calls = BTreeMap::new();
        let mut count = |m: &str| *calls.entry(m.to_string()).or_insert(0) += 1;
        count("getPluginParams");
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl("getPluginParams(UCX)"))?;
        count("createBackend");
        agent
            .create_backend("UCX", &params)
            .map_err(nixl("createBackend(UCX)"))?;
        let bytes = u64::from(spec.blocks) * u64::from(spec.block_size);
        let mut pool = SystemStorage::new(bytes as usize).map_err(nixl("allocating the pool"))?;
        pool.memset(spec.fill);
        let pool_addr = pool.as_slice().as_ptr() as u64;
        count("registerMem");
        let registration = agent
            .register_memory(&pool, None)
            .map_err(nixl("registerMem"))?;
        let pid = std::process::id();
        let reg = RegistrationRecord {
            pid,
            agent: spec.name.clone(),
            op: RegistrationOp::Register,
            bytes,
            addr: pool_addr,
            ok: true,
        };
        debug!(agent = %spec.name, port = spec.listen_port, pool_addr, bytes, "Worker agent ready.");
        Ok(Self {
            spec,
            pid,
            agent: Some(agent),
            pool,
            pool_addr,
            registration: Some(registration),
            sys_remotes: BTreeSet::new(),
            loaded: BTreeSet::new(),
            calls,
            next_seq: 1,
            pending_registrations: vec![reg],
        })
    }

    /// The agent name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    fn count(&mut self, method: &str) {
        *self.calls.entry(method.to_string()).or_insert(0) += 1;
    }

    fn seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// Carries out one command. A NIXL failure is data (a record), not an error; only a
    /// command the worker cannot carry out at all yields [`Reply::error`].
    pub fn handle(&mut self, cmd: Command) -> Reply {
        if self.agent.is_none() && !matches!(cmd, Command::Hello) {
            return Reply::failed(format!("agent {} was shut down", self.spec.name));
        }
        match cmd {
            Command::Hello => Reply {
                agent: Some(self.info()),
                registrations: std::mem::take(&mut self.pending_registrations),
                ..Reply::default()
            },
            Command::GetLocalMd => self.get_local_md(),
            Command::LoadRemoteMd {
                blob,
                peer,
                inject,
                phase,
            } => {
                let mut reply = Reply::default();
                self.load_remote_md(&blob, &peer, inject, phase, &mut reply);
                reply
            }
            Command::FetchRemoteMd {
                remote,
                port,
                wait_ms,
                inject,
            } => self.fetch_remote_md(&remote, port, wait_ms, inject),
            Command::SendLocalMd { to, port } => self.send_local_md(&to, port),
            Command::AwaitRemoteMd { remote, wait_ms } => {
                let mut reply = Reply::default();
                let (arrived, waited, checks) = self.await_remote_md(&remote, wait_ms, &mut reply);
                if arrived {
                    self.loaded.insert(remote);
                }
                reply.arrival = Some((arrived, waited, checks));
                reply
            }
            Command::MakeConnection {
                remote,
                inject,
                phase,
            } => self.make_connection(&remote, inject, phase),
            Command::InvalidateRemoteMd { remote, phase } => {
                let mut reply = Reply::default();
                if let Err(e) = self.invalidate(&remote, phase, &mut reply) {
                    return Reply::failed(e);
                }
                reply
            }
            Command::Transfer(spec) => self.transfer(spec),
            Command::Verify { blocks, fill } => {
                let ok = self.blocks_hold(&blocks, fill);
                self.pool.memset(self.spec.fill);
                Reply {
                    verified: Some(ok),
                    ..Reply::default()
                }
            }
            Command::GenNotif { to, msg } => self.gen_notif(&to, &msg),
            Command::CollectNotifs { expected, wait_ms } => self.collect_notifs(expected, wait_ms),
            Command::Shutdown => self.shutdown(),
            Command::Publish { .. } => {
                Reply::failed("this worker has no KV event publisher (worker --control has)")
            }
        }
    }

    fn agent(&self) -> &Agent {
        // handle() refuses every command but Hello once the agent is gone.
        self.agent
            .as_ref()
            .expect("agent present while handling commands")
    }

    fn info(&self) -> AgentInfo {
        AgentInfo {
            name: self.spec.name.clone(),
            pid: self.pid,
            listen_port: self.spec.listen_port,
            pool_addr: self.pool_addr,
            blocks: self.spec.blocks,
            block_size: self.spec.block_size,
            fill: self.spec.fill,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn handshake(
        &mut self,
        call: HandshakeCall,
        remote: Option<&str>,
        status: StatusSeen,
        started: (Instant, u64),
        phase: Phase,
        injected: Option<Injection>,
        peer_addr: Option<String>,
    ) -> HandshakeRecord {
        HandshakeRecord {
            seq: self.seq(),
            pid: self.pid,
            call,
            local: self.spec.name.clone(),
            remote: remote.map(str::to_string),
            outcome: CallOutcome::of(&status),
            status,
            wall_ns: elapsed_ns(started.0),
            started_unix_ns: started.1,
            phase,
            injected,
            peer_addr,
            async_load: None,
        }
    }

    fn get_local_md(&mut self) -> Reply {
        self.count("getLocalMD");
        match self.agent().get_local_md() {
            Ok(blob) => Reply {
                blob: Some(blob),
                ..Reply::default()
            },
            Err(e) => Reply::failed(format!("getLocalMD failed: {e}")),
        }
    }

    fn load_remote_md(
        &mut self,
        blob: &[u8],
        peer: &str,
        inject: Option<Injection>,
        phase: Phase,
        reply: &mut Reply,
    ) {
        let started = (Instant::now(), unix_ns());
        self.count("loadRemoteMD");
        let result = self.agent().load_remote_md(blob);
        let status = match &result {
            Ok(name) => {
                self.sys_remotes.insert(name.clone());
                self.loaded.insert(name.clone());
                StatusSeen::ok()
            }
            Err(e) => StatusSeen::from_error(
                e,
                inject.and_then(|i| native_for_injection(i, "loadRemoteMD")),
            ),
        };
        let remote = result.as_deref().unwrap_or(peer).to_string();
        let rec = self.handshake(
            HandshakeCall::LoadRemoteMd,
            Some(&remote),
            status,
            started,
            phase,
            inject,
            None,
        );
        reply.handshakes.push(rec);
    }

    fn socket_args(port: u16) -> Result<OptArgs, NixlError> {
        let mut o = OptArgs::new()?;
        o.set_ip_addr("127.0.0.1")?;
        o.set_port(port)?;
        Ok(o)
    }

    fn fetch_remote_md(
        &mut self,
        remote: &str,
        port: u16,
        wait_ms: u64,
        inject: Option<Injection>,
    ) -> Reply {
        let opts = match Self::socket_args(port) {
            Ok(o) => o,
            Err(e) => return Reply::failed(format!("building fetchRemoteMD arguments: {e}")),
        };
        let mut reply = Reply::default();
        let started = (Instant::now(), unix_ns());
        self.count("fetchRemoteMD");
        let result = self.agent().fetch_remote_md(remote, Some(&opts));
        let status = match &result {
            Ok(()) => {
                self.sys_remotes.insert(remote.to_string());
                StatusSeen::ok()
            }
            Err(e) => StatusSeen::from_error(e, None),
        };
        let mut rec = self.handshake(
            HandshakeCall::FetchRemoteMd,
            Some(remote),
            status,
            started,
            Phase::Handshake,
            inject,
            Some(format!("127.0.0.1:{port}")),
        );
        let mut checks = Reply::default();
        if result.is_ok() {
            let (arrived, _, check_calls) = self.await_remote_md(remote, wait_ms, &mut checks);
            if arrived {
                self.loaded.insert(remote.to_string());
            }
            rec.async_load = Some(AsyncLoad {
                loaded_by: self.spec.name.clone(),
                pid: self.pid,
                arrived,
                waited_ns: elapsed_ns(started.0),
                check_calls,
            });
        }
        reply.handshakes.push(rec);
        reply.handshakes.append(&mut checks.handshakes);
        reply
    }

    fn send_local_md(&mut self, to: &str, port: u16) -> Reply {
        let opts = match Self::socket_args(port) {
            Ok(o) => o,
            Err(e) => return Reply::failed(format!("building sendLocalMD arguments: {e}")),
        };
        let started = (Instant::now(), unix_ns());
        self.count("sendLocalMD");
        let status = match self.agent().send_local_md(Some(&opts)) {
            Ok(()) => StatusSeen::ok(),
            Err(e) => StatusSeen::from_error(&e, None),
        };
        let rec = self.handshake(
            HandshakeCall::SendLocalMd,
            Some(to),
            status,
            started,
            Phase::Handshake,
            None,
            Some(format!("127.0.0.1:{port}")),
        );
        Reply {
            handshakes: vec![rec],
            ..Reply::default()
        }
    }

    /// Polls `checkRemoteMD` (backing off from 200 µs to 20 ms) until `remote`'s
    /// metadata is loaded or `wait_ms` passed; every call becomes a record.
    fn await_remote_md(
        &mut self,
        remote: &str,
        wait_ms: u64,
        reply: &mut Reply,
    ) -> (bool, u64, u32) {
        let t0 = Instant::now();
        let deadline = Duration::from_millis(wait_ms);
        let mut pause = Duration::from_micros(200);
        let mut checks = 0u32;
        loop {
            let started = (Instant::now(), unix_ns());
            self.count("checkRemoteMD");
            checks += 1;
            let found = self.agent().check_remote_metadata(remote, None);
            let status = if found {
                StatusSeen::check_found()
            } else {
                StatusSeen::check_not_found()
            };
            let rec = self.handshake(
                HandshakeCall::CheckRemoteMd,
                Some(remote),
                status,
                started,
                Phase::Await,
                None,
                None,
            );
            reply.handshakes.push(rec);
            if found {
                return (true, elapsed_ns(t0), checks);
            }
            if t0.elapsed() >= deadline {
                return (false, elapsed_ns(t0), checks);
            }
            std::thread::sleep(pause.min(deadline.saturating_sub(t0.elapsed())));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    fn make_connection(&mut self, remote: &str, inject: Option<Injection>, phase: Phase) -> Reply {
        let started = (Instant::now(), unix_ns());
        self.count("makeConnection");
        let status = match self.agent().make_connection(remote, None) {
            Ok(()) => StatusSeen::ok(),
            Err(e) => StatusSeen::from_error(
                &e,
                inject.and_then(|i| native_for_injection(i, "makeConnection")),
            ),
        };
        let rec = self.handshake(
            HandshakeCall::MakeConnection,
            Some(remote),
            status,
            started,
            phase,
            inject,
            None,
        );
        Reply {
            handshakes: vec![rec],
            ..Reply::default()
        }
    }

    /// `invalidateRemoteMD` through nixl-sys, which only passes on names it tracks.
    fn invalidate(&mut self, remote: &str, phase: Phase, reply: &mut Reply) -> Result<(), String> {
        if !self.sys_remotes.contains(remote) {
            return Err(format!(
                "{}: nixl-sys does not track remote {remote} (its metadata came by sendLocalMD or \
                 was never loaded), so invalidate_remote_md would not reach NIXL",
                self.spec.name
            ));
        }
        let started = (Instant::now(), unix_ns());
        self.count("invalidateRemoteMD");
        let status = match self.agent().invalidate_remote_md(remote) {
            Ok(()) => {
                self.sys_remotes.remove(remote);
                StatusSeen::invalidated(self.loaded.remove(remote))
            }
            Err(e) => StatusSeen::from_error(&e, None),
        };
        let rec = self.handshake(
            HandshakeCall::InvalidateRemoteMd,
            Some(remote),
            status,
            started,
            phase,
            None,
            None,
        );
        reply.handshakes.push(rec);
        Ok(())
    }

    fn blocks_hold(&self, blocks: &[u32], fill: u8) -> bool {
        let bs = self.spec.block_size as usize;
        let data = self.pool.as_slice();
        blocks.iter().all(|&b| {
            let at = b as usize * bs;
            data.get(at..at + bs)
                .is_some_and(|blk| blk.iter().all(|&x| x == fill))
        })
    }

    fn transfer(&mut self, spec: TransferSpec) -> Reply {
        let mut reply = Reply::default();
        let in_flight = spec.inject == Some(Injection::InvalidatedInFlight);
        let attempts = if in_flight {
            spec.max_attempts.max(1)
        } else {
            1
        };
        for _ in 0..attempts {
            let mut record = match self.transfer_once(&spec, &mut reply) {
                Ok(r) => r,
                Err(e) => return Reply::failed(e),
            };
            // An in-flight injection needs a post that returns IN_PROG; a post that
            // completed at once is an ordinary done READ (nothing was injected into it),
            // and the worker tries again.
            let retry = in_flight && record.outcome == TransferOutcome::Done;
            if retry {
                record.injected = None;
            }
            reply.transfers.push(record);
            if !retry {
                break;
            }
        }
        reply
    }

    fn transfer_once(
        &mut self,
        spec: &TransferSpec,
        reply: &mut Reply,
    ) -> Result<TransferRecord, String> {
        let bs = u64::from(self.spec.block_size);
        if spec.local_blocks.len() != spec.remote_blocks.len() || spec.local_blocks.is_empty() {
            return Err("a transfer needs as many local as remote blocks (at least one)".into());
        }
        let mut local =
            XferDescList::new(MemType::Dram).map_err(|e| format!("XferDescList: {e}"))?;
        let mut remote =
            XferDescList::new(MemType::Dram).map_err(|e| format!("XferDescList: {e}"))?;
        // An injected descriptor mismatch leaves the last remote descriptor out.
        let remote_descs = spec.remote_blocks.len()
            - usize::from(spec.inject == Some(Injection::MismatchedDescriptors));
        for (k, (&l, &r)) in spec
            .local_blocks
            .iter()
            .zip(&spec.remote_blocks)
            .enumerate()
        {
            local.add_desc(
                (self.pool_addr + u64::from(l) * bs) as usize,
                bs as usize,
                0,
            );
            if k < remote_descs {
                remote.add_desc(
                    (spec.remote_pool_addr + u64::from(r) * bs) as usize,
                    bs as usize,
                    0,
                );
            }
        }
        let opts = match &spec.notif {
            Some(msg) => {
                let mut o = OptArgs::new().map_err(|e| format!("OptArgs: {e}"))?;
                o.set_notification_message(msg.as_bytes())
                    .map_err(|e| format!("OptArgs: {e}"))?;
                o.set_has_notification(true)
                    .map_err(|e| format!("OptArgs: {e}"))?;
                Some(o)
            }
            None => None,
        };
        let descriptors = spec.local_blocks.len() as u32;
        let native = |call: &str| spec.inject.and_then(|i| native_for_injection(i, call));

        if spec.inject == Some(Injection::InvalidatedRemote) {
            self.invalidate(&spec.remote, Phase::Inject, reply)?;
        }
        let seq = self.seq();
        let started_unix_ns = unix_ns();
        let mut record = TransferRecord {
            seq,
            pid: self.pid,
            local: self.spec.name.clone(),
            remote: spec.remote.clone(),
            prepped: spec.prepped,
            op: spec.op,
            descriptors,
            bytes: u64::from(descriptors) * bs,
            outcome: TransferOutcome::FailedAtCreate,
            status: StatusSeen::ok(),
            final_call: "createXferReq".into(),
            post_in_progress: None,
            status_polls: 0,
            post_to_done_ns: None,
            post_to_failure_ns: None,
            notif: spec.notif.clone(),
            injected: spec.inject,
            data_verified: None,
            released: false,
            started_unix_ns,
            telemetry_refused: None,
        };

        // Prepared lists outlive their request (declared first, dropped after it).
        let prepared = if spec.prepped {
            // NIXL_INIT_AGENT (""): the initiator's own side.
            let local = self
                .agent()
                .prepare_xfer_dlist("", &local, None)
                .map_err(|e| format!("prepXferDlist (local): {e}"))?;
            let remote = self
                .agent()
                .prepare_xfer_dlist(&spec.remote, &remote, None)
                .map_err(|e| format!("prepXferDlist ({}): {e}", spec.remote))?;
            Some((local, remote))
        } else {
            None
        };
        let creating = if prepared.is_some() {
            "makeXferReq"
        } else {
            "createXferReq"
        };
        record.final_call = creating.into();
        self.count(creating);
        let created = match &prepared {
            Some((local_list, remote_list)) => {
                let local_idx: Vec<i32> = (0..descriptors as i32).collect();
                let mut remote_idx = local_idx.clone();
                match spec.inject {
                    Some(Injection::PreppedMismatchedIndices) => {
                        remote_idx.pop();
                    }
                    Some(Injection::PreppedIndexPastEnd) => {
                        if let Some(last) = remote_idx.last_mut() {
                            *last = descriptors as i32;
                        }
                    }
                    _ => {}
                }
                self.agent().make_xfer_req(
                    spec.op.xfer_op(),
                    local_list,
                    &local_idx,
                    remote_list,
                    &remote_idx,
                    opts.as_ref(),
                )
            }
            None => self.agent().create_xfer_req(
                spec.op.xfer_op(),
                &local,
                &remote,
                &spec.remote,
                opts.as_ref(),
            ),
        };
        let req = match created {
            Ok(req) => req,
            Err(e) => {
                record.status = StatusSeen::from_error(&e, native(creating));
                return Ok(record);
            }
        };
        if spec.inject == Some(Injection::InvalidatedBeforePost) {
            self.invalidate(&spec.remote, Phase::Inject, reply)?;
        }

        let t0 = Instant::now();
        self.count("postXferReq");
        record.final_call = "postXferReq".into();
        match self.agent().post_xfer_req(&req, None) {
            Ok(false) => {
                record.post_in_progress = Some(false);
                record.outcome = TransferOutcome::Done;
                record.post_to_done_ns = Some(elapsed_ns(t0));
            }
            Ok(true) => {
                record.post_in_progress = Some(true);
                if spec.inject == Some(Injection::InvalidatedInFlight) {
                    self.invalidate(&spec.remote, Phase::Inject, reply)?;
                }
                let deadline = Duration::from_millis(spec.timeout_ms);
                record.final_call = "getXferStatus".into();
                loop {
                    self.count("getXferStatus");
                    record.status_polls += 1;
                    match self.agent().get_xfer_status(&req) {
                        Ok(XferStatus::Success) => {
                            record.outcome = TransferOutcome::Done;
                            record.status = StatusSeen::ok();
                            record.post_to_done_ns = Some(elapsed_ns(t0));
                            break;
                        }
                        Ok(XferStatus::InProgress) if t0.elapsed() >= deadline => {
                            warn!(agent = %self.spec.name, remote = %spec.remote, seq, "Transfer still in progress at the deadline; releasing it.");
                            record.outcome = TransferOutcome::TimedOut;
                            record.status = StatusSeen::in_progress();
                            record.post_to_failure_ns = Some(elapsed_ns(t0));
                            break;
                        }
                        Ok(XferStatus::InProgress) => std::thread::yield_now(),
                        Err(e) => {
                            record.outcome = TransferOutcome::FailedAtCompletion;
                            record.status = StatusSeen::from_error(&e, native("getXferStatus"));
                            record.post_to_failure_ns = Some(elapsed_ns(t0));
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                record.outcome = TransferOutcome::FailedAtPost;
                record.status = StatusSeen::from_error(&e, native("postXferReq"));
                record.post_to_failure_ns = Some(elapsed_ns(t0));
            }
        }
        // As vLLM's NixlConnector does for every finished transfer: its telemetry, which
        // an agent whose telemetry is off refuses (NIXL_ERR_NO_TELEMETRY).
        if record.outcome == TransferOutcome::Done {
            self.count("getXferTelemetry");
            record.telemetry_refused = Some(matches!(
                req.get_telemetry(),
                Err(nixl_sys::NixlError::NoTelemetry)
            ));
        }
        // Dropping the request calls releaseXferReq (and frees the C API wrapper).
        self.count("releaseXferReq");
        drop(req);
        record.released = true;

        if record.outcome == TransferOutcome::Done {
            if let (Op::Read, Some(fill)) = (spec.op, spec.verify_fill) {
                record.data_verified = Some(self.blocks_hold(&spec.local_blocks, fill));
                self.pool.memset(self.spec.fill);
            }
        }
        if let Some(msg) = &spec.notif {
            let certain = record.outcome == TransferOutcome::Done;
            let maybe = matches!(
                record.outcome,
                TransferOutcome::FailedAtCompletion | TransferOutcome::TimedOut
            );
            if certain || maybe {
                reply.notifications_sent.push(NotificationSent {
                    pid: self.pid,
                    from: self.spec.name.clone(),
                    to: spec.remote.clone(),
                    msg: msg.clone(),
                    via: NotifVia::Xfer,
                    transfer_seq: Some(seq),
                    status: None,
                    certain,
                });
            }
        }
        Ok(record)
    }

    fn gen_notif(&mut self, to: &str, msg: &str) -> Reply {
        self.count("genNotif");
        let status = match self.agent().send_notification(to, msg.as_bytes(), None) {
            Ok(()) => StatusSeen::ok(),
            Err(e) => StatusSeen::from_error(&e, None),
        };
        let certain = status.is_ok();
        Reply {
            notifications_sent: vec![NotificationSent {
                pid: self.pid,
                from: self.spec.name.clone(),
                to: to.to_string(),
                msg: msg.to_string(),
                via: NotifVia::GenNotif,
                transfer_seq: None,
                status: Some(status),
                certain,
            }],
            ..Reply::default()
        }
    }

    fn collect_notifs(&mut self, expected: u32, wait_ms: u64) -> Reply {
        let mut reply = Reply::default();
        let mut map = match NotificationMap::new() {
            Ok(m) => m,
            Err(e) => return Reply::failed(format!("NotificationMap: {e}")),
        };
        let t0 = Instant::now();
        loop {
            self.count("getNotifs");
            if let Err(e) = self.agent().get_notifications(&mut map, None) {
                warn!(agent = %self.spec.name, error = %e, "getNotifs failed.");
            }
            match map.take_notifs() {
                Ok(by_agent) => {
                    let mut senders: Vec<_> = by_agent.into_iter().collect();
                    senders.sort();
                    for (from, msgs) in senders {
                        for msg in msgs {
                            reply.notifications_received.push(NotificationReceived {
                                pid: self.pid,
                                agent: self.spec.name.clone(),
                                from: from.clone(),
                                msg,
                            });
                        }
                    }
                }
                Err(e) => {
                    warn!(agent = %self.spec.name, error = %e, "Reading notifications failed.")
                }
            }
            if reply.notifications_received.len() >= expected as usize
                || t0.elapsed() >= Duration::from_millis(wait_ms)
            {
                return reply;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn shutdown(&mut self) -> Reply {
        let mut reply = Reply::default();
        for remote in self.sys_remotes.clone() {
            // invalidate() only fails for names nixl-sys does not track; these are its.
            let _ = self.invalidate(&remote, Phase::Teardown, &mut reply);
        }
        // A remote still tracked (its invalidation failed) is invalidated once more by
        // nixl-sys's Drop of the agent: count that call too; its status is not observable.
        for remote in std::mem::take(&mut self.sys_remotes) {
            self.count("invalidateRemoteMD");
            let status = StatusSeen {
                nixl_sys: "unobserved (nixl-sys Drop)".into(),
                capi: None,
                nixl: None,
                nixl_name: None,
            };
            let rec = self.handshake(
                HandshakeCall::InvalidateRemoteMd,
                Some(&remote),
                status,
                (Instant::now(), unix_ns()),
                Phase::Teardown,
                None,
                None,
            );
            reply.handshakes.push(rec);
        }
        if let Some(mut reg) = self.registration.take() {
            self.count("deregisterMem");
            let ok = reg.deregister().is_ok();
            reply.registrations.push(RegistrationRecord {
                pid: self.pid,
                agent: self.spec.name.clone(),
                op: RegistrationOp::Deregister,
                bytes: u64::from(self.spec.blocks) * u64::from(self.spec.block_size),
                addr: self.pool_addr,
                ok,
            });
        }
        // Destroys the backend and the nixlAgent (its progress and listener threads).
        self.agent = None;
        reply.calls = Some(self.calls.clone());
        debug!(agent = %self.spec.name, "Worker agent destroyed.");
        reply
    }
}

/// End this worker process (status 3) once `deadline` has passed, whatever it is doing.
pub fn exit_after(deadline: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(deadline);
        eprintln!("kvscope-nixl-lab worker: deadline of {deadline:?} reached; exiting");
        std::process::exit(3);
    });
}

/// Runs a worker process: creates the worker from `spec`, then answers one command per
/// line on stdin with one reply per line on stdout until `Shutdown` or end of input.
/// `deadline` bounds the whole life of the process; `start_delay` is a pause after the
/// NIXL libraries are mapped and before the agent is created.
pub fn serve_stdio(
    spec: WorkerSpec,
    deadline: Duration,
    start_delay: Duration,
) -> Result<(), String> {
    exit_after(deadline);
    let stdout = std::io::stdout();
    let send = |reply: &Reply| -> Result<(), String> {
        let line = serde_json::to_string(reply).map_err(|e| e.to_string())?;
        let mut out = stdout.lock();
        writeln!(out, "{LINE_PREFIX}{line}")
            .and_then(|_| out.flush())
            .map_err(|e| e.to_string())
    };
    if !start_delay.is_zero() {
        // is_stub() dlopens libnixl_capi.so (and with it libnixl.so) without a NIXL call.
        let _ = nixl_sys::is_stub();
        std::thread::sleep(start_delay);
    }
    let mut worker = match Worker::new(spec) {
        Ok(w) => w,
        Err(e) => {
            send(&Reply::failed(e.to_string()))?;
            return Err(e.to_string());
        }
    };
    let stdin = std::io::stdin();
    if !serve_lines(stdin.lock(), send, |cmd| worker.handle(cmd))? {
        // The coordinator is gone (end of input): release everything in order anyway.
        let _ = worker.handle(Command::Shutdown);
    }
    Ok(())
}

/// Answer one command per protocol line of `input` through `send`, until `Shutdown`
/// (answered: `true`) or the end of input (`false`). Lines without [`LINE_PREFIX`] are
/// skipped.
pub fn serve_lines(
    input: impl BufRead,
    send: impl Fn(&Reply) -> Result<(), String>,
    mut handle: impl FnMut(Command) -> Reply,
) -> Result<bool, String> {
    for line in input.lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Some(json) = line.strip_prefix(LINE_PREFIX) else {
            continue;
        };
        let cmd: Command = match serde_json::from_str(json) {
            Ok(c) => c,
            Err(e) => {
                send(&Reply::failed(format!("bad command: {e}")))?;
                continue;
            }
        };
        let last = matches!(cmd, Command::Shutdown);
        send(&handle(cmd))?;
        if last {
            return Ok(true);
        }
    }
    Ok(false)
}
