//! The coordinator: starts the workers, carries out a [`Plan`] against them and
//! assembles the [`Truth`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::libs::{NixlLibs, NIXL_SYS_VERSION};
use crate::link::{LinkError, WorkerLink};
use crate::plan::{MdPath, Plan, PlanError, Remote, RunConfig, Step};
use crate::protocol::{AgentInfo, Command, Reply, TransferSpec, WorkerSpec};
use crate::status::Injection;
use crate::truth::{
    AgentRecord, AsyncLoad, NixlBuild, Notifications, Op, Phase, Summary, TransferOutcome, Truth,
    WorkerMode, TRUTH_SCHEMA,
};
use crate::worker::unix_ns;

/// Why a run could not be carried out (NIXL failures are not errors: they are truth).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The config cannot be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// No free ports for the listeners.
    #[error("picking listener ports: {0}")]
    Ports(std::io::Error),
    /// A worker could not be started or reached.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// A worker could not carry out a command.
    #[error("worker {agent} could not carry out {command}: {error}")]
    Worker {
        /// Agent.
        agent: String,
        /// The command.
        command: String,
        /// Its explanation.
        error: String,
    },
    /// Process mode needs the path of the `kvscope-nixl-lab` binary.
    #[error("running workers as processes needs the kvscope-nixl-lab executable")]
    NoWorkerExe,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Scenario name recorded in the truth.
    pub scenario: String,
    /// What to do.
    pub config: RunConfig,
    /// Agents in this process or one process each.
    pub mode: WorkerMode,
    /// The wheel's libraries.
    pub libs: NixlLibs,
    /// The `kvscope-nixl-lab` binary (for [`WorkerMode::Processes`]).
    pub worker_exe: Option<PathBuf>,
    /// Upper bound on a worker process's life.
    pub worker_deadline: Duration,
    /// Pause after the libraries are mapped and before the first NIXL call (in every
    /// process that makes NIXL calls), so a tracer scanning `/proc/*/maps` finds them.
    pub start_delay: Duration,
}

struct Coordinator {
    plan: Plan,
    config: RunConfig,
    links: Vec<Option<WorkerLink>>,
    infos: Vec<AgentInfo>,
    ports: Vec<u16>,
    dead_ports: Vec<u16>,
    truth: Truth,
    calls: Vec<BTreeMap<String, u64>>,
    retired: Vec<bool>,
    next_seq: u64,
}

/// Runs the plan for `opts.config` and returns the truth.
pub fn run(opts: RunOptions) -> Result<Truth, RunError> {
    let t0 = Instant::now();
    let started_unix_ns = unix_ns();
    let plan = Plan::build(&opts.config)?;
    let n = plan.names.len();
    // Held for the whole run: no lab alongside takes a listener's port before its agent
    // binds it (after the start delay), nor a dead port meant to stay unanswered.
    let reservation =
        kvscope_lab::ports::reserve_ports(n + plan.dead_ports).map_err(RunError::Ports)?;
    let ports = reservation.ports();
    let (ports, dead_ports) = (ports[..n].to_vec(), ports[n..].to_vec());
    if opts.mode == WorkerMode::InProcess && !opts.start_delay.is_zero() {
        // is_stub() dlopens libnixl_capi.so (and with it libnixl.so) without a NIXL call.
        let mapped = !nixl_sys::is_stub();
        info!(
            mapped,
            delay_ms = opts.start_delay.as_millis() as u64,
            "NIXL libraries mapped; waiting before the first call."
        );
        std::thread::sleep(opts.start_delay);
    }
    let mut links = Vec::with_capacity(n);
    for (i, name) in plan.names.iter().enumerate() {
        let spec = WorkerSpec {
            name: name.clone(),
            listen_port: ports[i],
            blocks: opts.config.blocks,
            block_size: opts.config.block_size,
            fill: plan.fills[i],
            listener_delay_us: opts.config.listener_delay_us,
            progress_delay_us: opts.config.progress_delay_us,
        };
        let link = match opts.mode {
            WorkerMode::InProcess => WorkerLink::in_process(spec)?,
            WorkerMode::Processes => {
                let exe = opts.worker_exe.as_deref().ok_or(RunError::NoWorkerExe)?;
                WorkerLink::spawn(
                    exe,
                    &opts.libs,
                    &spec,
                    opts.worker_deadline,
                    opts.start_delay,
                )?
            }
        };
        links.push(Some(link));
    }
    let truth = Truth {
        schema: TRUTH_SCHEMA,
        scenario: opts.scenario.clone(),
        mode: opts.mode,
        run_pid: std::process::id(),
        nixl: NixlBuild {
            version: opts.libs.version.clone(),
            libnixl: opts.libs.libnixl.display().to_string(),
            build_id: opts.libs.build_id.clone(),
            nixl_sys: NIXL_SYS_VERSION.to_string(),
        },
        config: opts.config.clone(),
        started_unix_ns,
        wall_ns: 0,
        agents: Vec::new(),
        handshakes: Vec::new(),
        transfers: Vec::new(),
        notifications: Notifications::default(),
        registrations: Vec::new(),
        summary: Summary::default(),
    };
    let mut c = Coordinator {
        config: opts.config.clone(),
        links,
        infos: Vec::new(),
        ports,
        dead_ports,
        truth,
        calls: vec![BTreeMap::new(); n],
        retired: vec![false; n],
        next_seq: 1,
        plan,
    };
    for i in 0..n {
        let reply = c.call(i, Command::Hello)?;
        let info = reply.agent.clone().ok_or_else(|| RunError::Worker {
            agent: c.plan.names[i].clone(),
            command: "hello".into(),
            error: "no agent info in the reply".into(),
        })?;
        c.absorb(reply);
        c.infos.push(info);
    }
    info!(workers = n, mode = ?opts.mode, "NIXL lab agents ready.");
    for step in c.plan.steps.clone() {
        c.step(step)?;
    }
    c.truth.agents = c
        .infos
        .iter()
        .enumerate()
        .map(|(i, a)| AgentRecord {
            name: a.name.clone(),
            pid: a.pid,
            listen_port: a.listen_port,
            blocks: a.blocks,
            block_size: a.block_size,
            pool_addr: a.pool_addr,
            fill: a.fill,
            retired_early: Some(i) == c.plan.doomed,
            calls: c.calls[i].clone(),
        })
        .collect();
    c.truth.wall_ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    c.truth.finish();
    let problems = c.truth.check();
    for p in &problems {
        warn!(problem = %p, "Truth is not self-consistent.");
    }
    Ok(c.truth)
}

impl Coordinator {
    fn name(&self, i: usize) -> String {
        self.plan.names[i].clone()
    }

    fn call(&mut self, i: usize, cmd: Command) -> Result<Reply, RunError> {
        let command = cmd.name().to_string();
        let link = self.links[i].as_mut().ok_or_else(|| RunError::Worker {
            agent: self.plan.names[i].clone(),
            command: command.clone(),
            error: "worker already shut down".into(),
        })?;
        let reply = link.call(cmd)?;
        if let Some(error) = reply.error.clone() {
            return Err(RunError::Worker {
                agent: self.plan.names[i].clone(),
                command,
                error,
            });
        }
        Ok(reply)
    }

    /// Files a reply's records under global sequence numbers (in the worker's order).
    /// Returns the local → global seq mapping.
    fn absorb(&mut self, reply: Reply) -> BTreeMap<u64, u64> {
        let mut local: Vec<u64> = reply
            .handshakes
            .iter()
            .map(|h| h.seq)
            .chain(reply.transfers.iter().map(|t| t.seq))
            .collect();
        local.sort_unstable();
        let mut map = BTreeMap::new();
        for l in local {
            map.insert(l, self.next_seq);
            self.next_seq += 1;
        }
        for mut h in reply.handshakes {
            h.seq = map[&h.seq];
            self.truth.handshakes.push(h);
        }
        for mut t in reply.transfers {
            t.seq = map[&t.seq];
            self.truth.transfers.push(t);
        }
        for mut n in reply.notifications_sent {
            n.transfer_seq = n.transfer_seq.and_then(|s| map.get(&s).copied());
            self.truth.notifications.sent.push(n);
        }
        self.truth
            .notifications
            .received
            .extend(reply.notifications_received);
        self.truth.registrations.extend(reply.registrations);
        map
    }

    fn blob(&mut self, i: usize) -> Result<Vec<u8>, RunError> {
        let reply = self.call(i, Command::GetLocalMd)?;
        reply.blob.ok_or_else(|| RunError::Worker {
            agent: self.name(i),
            command: "get_local_md".into(),
            error: "no blob in the reply".into(),
        })
    }

    fn load_direct(&mut self, loader: usize, peer: usize, phase: Phase) -> Result<(), RunError> {
        let blob = self.blob(peer)?;
        let reply = self.call(
            loader,
            Command::LoadRemoteMd {
                blob,
                peer: self.name(peer),
                inject: None,
                phase,
            },
        )?;
        self.absorb(reply);
        Ok(())
    }

    fn shutdown(&mut self, i: usize) -> Result<(), RunError> {
        let reply = self.call(i, Command::Shutdown)?;
        if let Some(calls) = &reply.calls {
            self.calls[i] = calls.clone();
        }
        self.absorb(reply);
        // The link stays: an in-process worker keeps its (deregistered) pool allocated,
        // so a transfer that still reached it could not touch unmapped memory.
        if let Some(link) = self.links[i].as_mut() {
            link.finish(Duration::from_secs(10))?;
        }
        self.retired[i] = true;
        Ok(())
    }

    fn step(&mut self, step: Step) -> Result<(), RunError> {
        let c = self.config.clone();
        match step {
            Step::Exchange { loader, peer, path } => match path {
                MdPath::Direct => self.load_direct(loader, peer, Phase::Handshake)?,
                MdPath::Fetch => {
                    let cmd = Command::FetchRemoteMd {
                        remote: self.name(peer),
                        port: self.ports[peer],
                        wait_ms: c.md_wait_ms,
                        inject: None,
                    };
                    let reply = self.call(loader, cmd)?;
                    self.absorb(reply);
                }
                MdPath::Send => {
                    let cmd = Command::SendLocalMd {
                        to: self.name(loader),
                        port: self.ports[loader],
                    };
                    let mut sent = self.call(peer, cmd)?;
                    let cmd = Command::AwaitRemoteMd {
                        remote: self.name(peer),
                        wait_ms: c.md_wait_ms,
                    };
                    let awaited = self.call(loader, cmd)?;
                    if let (Some((arrived, waited_ns, check_calls)), Some(rec)) =
                        (awaited.arrival, sent.handshakes.first_mut())
                    {
                        rec.async_load = Some(AsyncLoad {
                            loaded_by: self.name(loader),
                            pid: self.infos[loader].pid,
                            arrived,
                            waited_ns,
                            check_calls,
                        });
                    }
                    self.absorb(sent);
                    self.absorb(awaited);
                }
            },
            Step::Connect { from, to } => {
                let cmd = Command::MakeConnection {
                    remote: self.name(to),
                    inject: None,
                    phase: Phase::Handshake,
                };
                let reply = self.call(from, cmd)?;
                self.absorb(reply);
            }
            Step::CorruptLoad {
                loader,
                peer,
                corruption,
            } => {
                let blob = corruption.apply(&self.blob(peer)?);
                let cmd = Command::LoadRemoteMd {
                    blob,
                    peer: self.name(peer),
                    inject: Some(Injection::CorruptMetadata),
                    phase: Phase::Inject,
                };
                let reply = self.call(loader, cmd)?;
                self.absorb(reply);
            }
            Step::DeadFetch { loader, ghost, k } => {
                let cmd = Command::FetchRemoteMd {
                    remote: ghost,
                    port: self.dead_ports[k],
                    wait_ms: c.dead_listener_wait_ms,
                    inject: Some(Injection::DeadListener),
                };
                let reply = self.call(loader, cmd)?;
                self.absorb(reply);
            }
            Step::UnknownConnect { from, ghost } => {
                let cmd = Command::MakeConnection {
                    remote: ghost,
                    inject: Some(Injection::UnknownConnect),
                    phase: Phase::Inject,
                };
                let reply = self.call(from, cmd)?;
                self.absorb(reply);
            }
            Step::Retire { worker } => self.shutdown(worker)?,
            Step::Transfer {
                initiator,
                remote,
                op,
                local_blocks,
                remote_blocks,
                notif,
                inject,
                prepped,
            } => {
                let (remote_name, remote_addr, remote_fill, remote_idx) = match &remote {
                    Remote::Worker(r) => (
                        self.name(*r),
                        self.infos[*r].pool_addr,
                        Some(self.infos[*r].fill),
                        Some(*r),
                    ),
                    Remote::Ghost(g) => (g.clone(), self.infos[initiator].pool_addr, None, None),
                };
                let spec = TransferSpec {
                    op,
                    remote: remote_name,
                    local_blocks,
                    remote_pool_addr: remote_addr,
                    remote_blocks: remote_blocks.clone(),
                    notif,
                    inject,
                    prepped,
                    verify_fill: if op == Op::Read { remote_fill } else { None },
                    timeout_ms: c.transfer_timeout_ms,
                    max_attempts: c.in_flight_attempts,
                    phase: if inject.is_some() {
                        Phase::Inject
                    } else {
                        Phase::Migrate
                    },
                };
                let reply = self.call(initiator, Command::Transfer(spec))?;
                let done_writes: Vec<u64> = reply
                    .transfers
                    .iter()
                    .filter(|t| t.op == Op::Write && t.outcome == TransferOutcome::Done)
                    .map(|t| t.seq)
                    .collect();
                let map = self.absorb(reply);
                // A WRITE lands in the remote's pool: the remote checks it.
                if let (Some(r), false) = (remote_idx, done_writes.is_empty()) {
                    if !self.retired[r] {
                        let fill = self.infos[initiator].fill;
                        let verified = self
                            .call(
                                r,
                                Command::Verify {
                                    blocks: remote_blocks,
                                    fill,
                                },
                            )?
                            .verified;
                        for local in done_writes {
                            let global = map[&local];
                            if let Some(t) =
                                self.truth.transfers.iter_mut().find(|t| t.seq == global)
                            {
                                t.data_verified = verified;
                            }
                        }
                    }
                }
            }
            Step::Restore { loader, peer } => self.load_direct(loader, peer, Phase::Restore)?,
            Step::GenNotif { from, to, msg } => {
                let reply = self.call(
                    from,
                    Command::GenNotif {
                        to: self.name(to),
                        msg,
                    },
                )?;
                self.absorb(reply);
            }
            Step::CollectNotifs => {
                for i in 0..self.links.len() {
                    if self.retired[i] {
                        continue;
                    }
                    let name = self.name(i);
                    let expected = self
                        .truth
                        .notifications
                        .sent
                        .iter()
                        .filter(|n| n.to == name && n.certain)
                        .count() as u32;
                    let reply = self.call(
                        i,
                        Command::CollectNotifs {
                            expected,
                            wait_ms: c.notif_wait_ms,
                        },
                    )?;
                    let got = reply.notifications_received.len() as u32;
                    if got < expected {
                        warn!(agent = %name, expected, got, "Fewer notifications arrived than were sent.");
                    }
                    self.absorb(reply);
                }
            }
            Step::Shutdown => {
                for i in 0..self.links.len() {
                    if !self.retired[i] {
                        self.shutdown(i)?;
                    }
                }
            }
        }
        Ok(())
    }
}
