//! The serving workers' NIXL side: one driver thread takes jobs from the HTTP handlers
//! and drives every agent — in this process (as in `run`'s in-process mode), or in an
//! engine's sidecar over its control socket (`kvscope-nixl-lab sidecar`). At start every ordered
//! pair exchanges metadata and moves one probe block, so the path is proven and its
//! bandwidth measured before any directive (the actuator prices migrations from these
//! figures). A migration is then a fresh handshake (the target loads the source's
//! current metadata: the fork's "producer handshake") and a READ of the source's blocks
//! into the target's landing blocks, whose bytes are checked.

use std::sync::mpsc;
use std::time::Duration;

use serde::Serialize;

use crate::link::WorkerLink;
use crate::plan::Corruption;
use crate::protocol::{AgentInfo, Command, Reply, TransferSpec, WorkerSpec};
use crate::status::Injection;
use crate::truth::{CallOutcome, HandshakeRecord, Op, Phase, TransferOutcome, TransferRecord};

/// How long a transfer may stay in progress.
const TRANSFER_TIMEOUT_MS: u64 = 5_000;

/// One migration for the driver: indices into the fleet, the source's pool blocks.
#[derive(Debug, Clone)]
pub struct MigrationJob {
    pub source: usize,
    pub target: usize,
    /// Source pool blocks holding the KV, in order.
    pub source_blocks: Vec<u32>,
    /// Mangle the source's metadata before the target loads it (injected handshake
    /// failure: `loadRemoteMD` returns NIXL_ERR_MISMATCH).
    pub corrupt_handshake: bool,
    /// The notification each READ carries, as vLLM's NixlConnector sends it:
    /// `<request id>:1` (one reader), so the probes can tell the request.
    pub notif: Option<String>,
}

/// How a migration failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationFailure {
    /// The target could not load the source's metadata.
    HandshakeFailed,
    /// A READ did not complete.
    TransferFailed,
    /// A READ completed but the landing blocks do not hold the source's bytes.
    DataMismatch,
    /// The lab itself could not carry out a step (a bug or a dead agent).
    Lab,
}

/// What the driver did for a job: every NIXL record it made, and the verdict.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MigrationReport {
    pub failure: Option<MigrationFailure>,
    pub detail: Option<String>,
    pub handshakes: Vec<HandshakeRecord>,
    pub transfers: Vec<TransferRecord>,
    /// Bytes READ and checked.
    pub bytes: u64,
}

enum Job {
    Migrate(MigrationJob, tokio::sync::oneshot::Sender<MigrationReport>),
    Publish(
        usize,
        Vec<kvscope_wire::KvEvent>,
        tokio::sync::oneshot::Sender<Result<(), String>>,
    ),
    Shutdown(tokio::sync::oneshot::Sender<()>),
}

/// The handle the HTTP side holds.
#[derive(Clone)]
pub struct FleetHandle {
    jobs: mpsc::Sender<Job>,
}

/// What the fleet looked like once up.
#[derive(Debug, Clone, Serialize)]
pub struct FleetUp {
    pub agents: Vec<AgentInfo>,
    /// Per worker, its sidecar's KV event publisher (none in this process).
    pub kv_endpoints: Vec<Option<String>>,
    /// The start-up handshakes and probe transfers.
    pub handshakes_ok: u64,
    pub probe_transfers_ok: u64,
}

impl FleetHandle {
    /// Perform a migration on the driver thread.
    pub async fn migrate(&self, job: MigrationJob) -> MigrationReport {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.jobs.send(Job::Migrate(job, tx)).is_err() {
            return lab_failure("the NIXL driver thread is gone");
        }
        rx.await
            .unwrap_or_else(|_| lab_failure("the NIXL driver dropped the job"))
    }

    /// Publish `events` on sidecar `worker`'s own KV event publisher.
    pub async fn publish(
        &self,
        worker: usize,
        events: Vec<kvscope_wire::KvEvent>,
    ) -> Result<(), String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Job::Publish(worker, events, tx))
            .map_err(|_| "the NIXL driver thread is gone".to_string())?;
        rx.await
            .unwrap_or_else(|_| Err("the NIXL driver dropped the job".into()))
    }

    /// Invalidate, deregister and destroy every agent.
    pub async fn shutdown(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.jobs.send(Job::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

fn lab_failure(detail: impl Into<String>) -> MigrationReport {
    MigrationReport {
        failure: Some(MigrationFailure::Lab),
        detail: Some(detail.into()),
        ..MigrationReport::default()
    }
}

/// Where a serving worker's agent runs.
#[derive(Debug, Clone)]
pub enum Member {
    /// In this process, set up from the spec.
    InProcess(WorkerSpec),
    /// In a sidecar, reached through its ready file.
    Sidecar(std::path::PathBuf),
}

/// Start the driver thread with one agent per member, run the start-up handshakes and
/// probes, and return once the fleet is up (or why it is not).
pub fn start(specs: Vec<Member>) -> Result<(FleetHandle, FleetUp), String> {
    let (jobs, rx) = mpsc::channel();
    let (up_tx, up_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("nixl-driver".into())
        .spawn(move || match Driver::start(specs) {
            Ok((mut driver, up)) => {
                let _ = up_tx.send(Ok(up));
                driver.serve(rx);
            }
            Err(e) => {
                let _ = up_tx.send(Err(e));
            }
        })
        .map_err(|e| format!("spawning the NIXL driver thread: {e}"))?;
    let up = up_rx
        .recv_timeout(Duration::from_secs(60))
        .map_err(|e| format!("the NIXL fleet did not come up: {e}"))??;
    Ok((FleetHandle { jobs }, up))
}

struct Driver {
    workers: Vec<WorkerLink>,
    infos: Vec<AgentInfo>,
    /// loaded[target][source]: the target holds the source's metadata.
    loaded: Vec<Vec<bool>>,
}

fn call(w: &mut WorkerLink, cmd: Command) -> Result<Reply, String> {
    let what = cmd.name();
    let reply = w.call(cmd).map_err(|e| e.to_string())?;
    match reply.error {
        Some(e) => Err(format!("worker {} {what}: {e}", w.pid())),
        None => Ok(reply),
    }
}

/// How long a sidecar's ready file may take to appear.
const SIDECAR_WAIT: Duration = Duration::from_secs(60);

impl Driver {
    fn start(specs: Vec<Member>) -> Result<(Self, FleetUp), String> {
        let mut workers = Vec::new();
        let mut infos = Vec::new();
        for spec in specs {
            let mut w = match spec {
                Member::InProcess(spec) => WorkerLink::in_process(spec),
                Member::Sidecar(ready) => WorkerLink::sidecar(&ready, SIDECAR_WAIT),
            }
            .map_err(|e| e.to_string())?;
            let info = call(&mut w, Command::Hello)?
                .agent
                .ok_or("hello carried no agent info")?;
            workers.push(w);
            infos.push(info);
        }
        let n = workers.len();
        let mut d = Driver {
            workers,
            infos,
            loaded: vec![vec![false; n]; n],
        };
        let mut up = FleetUp {
            agents: d.infos.clone(),
            kv_endpoints: d
                .workers
                .iter()
                .map(|w| w.kv_endpoint().map(str::to_string))
                .collect(),
            handshakes_ok: 0,
            probe_transfers_ok: 0,
        };
        for t in 0..n {
            for s in (0..n).filter(|&s| s != t) {
                let mut report = MigrationReport::default();
                d.handshake(t, s, false, Phase::Handshake, &mut report)?;
                if report.failure.is_some() {
                    return Err(format!(
                        "start-up handshake {} ← {} failed: {:?}",
                        d.infos[t].name, d.infos[s].name, report.detail
                    ));
                }
                up.handshakes_ok += 1;
                d.read(t, s, &[0], None, &mut report)?;
                if report.failure.is_some() {
                    return Err(format!(
                        "start-up probe READ {} ← {} failed: {:?}",
                        d.infos[t].name, d.infos[s].name, report.detail
                    ));
                }
                up.probe_transfers_ok += 1;
            }
        }
        Ok((d, up))
    }

    fn serve(&mut self, rx: mpsc::Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            match job {
                Job::Migrate(job, reply) => {
                    let _ = reply.send(self.migrate(&job));
                }
                Job::Publish(i, events, reply) => {
                    let r = match self.workers.get_mut(i) {
                        Some(w) => call(w, Command::Publish { events }).map(|_| ()),
                        None => Err(format!("no worker {i}")),
                    };
                    let _ = reply.send(r);
                }
                Job::Shutdown(done) => {
                    for w in &mut self.workers {
                        let _ = w.call(Command::Shutdown);
                    }
                    let _ = done.send(());
                    return;
                }
            }
        }
    }

    fn migrate(&mut self, job: &MigrationJob) -> MigrationReport {
        let mut report = MigrationReport::default();
        let n = self.workers.len();
        if job.source >= n || job.target >= n || job.source == job.target {
            return lab_failure("source and target must be two different workers of this lab");
        }
        let steps = (|| -> Result<(), String> {
            self.handshake(
                job.target,
                job.source,
                job.corrupt_handshake,
                Phase::Migrate,
                &mut report,
            )?;
            if report.failure.is_some() {
                return Ok(());
            }
            // The landing area is the second half of the pool: move in rounds of that.
            let landing = (self.infos[job.target].blocks / 2).max(1) as usize;
            for chunk in job.source_blocks.chunks(landing) {
                self.read(
                    job.target,
                    job.source,
                    chunk,
                    job.notif.clone(),
                    &mut report,
                )?;
                if report.failure.is_some() {
                    break;
                }
            }
            Ok(())
        })();
        if let Err(e) = steps {
            report.failure = Some(MigrationFailure::Lab);
            report.detail = Some(e);
        }
        report
    }

    /// The target loads the source's current metadata (invalidating what it held, so
    /// every migration makes a real handshake).
    fn handshake(
        &mut self,
        t: usize,
        s: usize,
        corrupt: bool,
        phase: Phase,
        report: &mut MigrationReport,
    ) -> Result<(), String> {
        let source = self.infos[s].name.clone();
        if self.loaded[t][s] {
            let r = call(
                &mut self.workers[t],
                Command::InvalidateRemoteMd {
                    remote: source.clone(),
                    phase,
                },
            )?;
            report.handshakes.extend(r.handshakes);
            self.loaded[t][s] = false;
        }
        let blob = call(&mut self.workers[s], Command::GetLocalMd)?
            .blob
            .ok_or("getLocalMD returned no blob")?;
        let blob = if corrupt {
            Corruption::FlipHeader.apply(&blob)
        } else {
            blob
        };
        let r = call(
            &mut self.workers[t],
            Command::LoadRemoteMd {
                blob,
                peer: source.clone(),
                inject: corrupt.then_some(Injection::CorruptMetadata),
                phase,
            },
        )?;
        let ok = r
            .handshakes
            .last()
            .is_some_and(|h| h.outcome == CallOutcome::Ok);
        report.handshakes.extend(r.handshakes);
        if ok {
            self.loaded[t][s] = true;
        } else {
            report.failure = Some(MigrationFailure::HandshakeFailed);
            report.detail = Some(format!(
                "{} could not load {source}'s metadata (loadRemoteMD failed)",
                self.infos[t].name
            ));
        }
        Ok(())
    }

    /// The target READs `blocks` of the source's pool into its landing blocks and checks
    /// they hold the source's bytes.
    fn read(
        &mut self,
        t: usize,
        s: usize,
        blocks: &[u32],
        notif: Option<String>,
        report: &mut MigrationReport,
    ) -> Result<(), String> {
        let half = self.infos[t].blocks / 2;
        let spec = TransferSpec {
            op: Op::Read,
            remote: self.infos[s].name.clone(),
            local_blocks: (0..blocks.len() as u32).map(|i| half + i).collect(),
            remote_pool_addr: self.infos[s].pool_addr,
            remote_blocks: blocks.to_vec(),
            notif,
            inject: None,
            prepped: false,
            verify_fill: Some(self.infos[s].fill),
            timeout_ms: TRANSFER_TIMEOUT_MS,
            max_attempts: 1,
            phase: Phase::Migrate,
        };
        let r = call(&mut self.workers[t], Command::Transfer(spec))?;
        report.handshakes.extend(r.handshakes);
        let Some(rec) = r.transfers.last().cloned() else {
            return Err("the transfer produced no record".into());
        };
        report.transfers.extend(r.transfers);
        if rec.outcome != TransferOutcome::Done {
            report.failure = Some(MigrationFailure::TransferFailed);
            report.detail = Some(format!(
                "READ {} ← {} ended {:?} ({})",
                self.infos[t].name, self.infos[s].name, rec.outcome, rec.final_call
            ));
            return Ok(());
        }
        if rec.data_verified != Some(true) {
            report.failure = Some(MigrationFailure::DataMismatch);
            report.detail = Some(format!(
                "READ {} ← {} completed but the landing blocks do not hold the source's bytes",
                self.infos[t].name, self.infos[s].name
            ));
            return Ok(());
        }
        report.bytes += rec.bytes;
        // Refill the pool with the target's own byte, so the next check cannot pass on
        // bytes an earlier READ left behind.
        call(
            &mut self.workers[t],
            Command::Verify {
                blocks: vec![],
                fill: self.infos[t].fill,
            },
        )?;
        Ok(())
    }
}
