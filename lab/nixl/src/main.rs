//! `kvscope-nixl-lab`: real NIXL 1.5.1 agents doing handshakes, KV block migrations and
//! injected failures, printing their ground truth.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use kvscope_nixl_lab::bench::{self, BenchConfig};
use kvscope_nixl_lab::plan::RunConfig;
use kvscope_nixl_lab::protocol::WorkerSpec;
use kvscope_nixl_lab::run::{self, RunOptions};
use kvscope_nixl_lab::truth::{Op, WorkerMode};
use kvscope_nixl_lab::{setup, worker, NixlLibs, REEXEC_MARKER_ENV};

/// The `run` config fields `--set` accepts (checked against [`RunConfig`] by a test).
const RUN_FIELDS_HELP: &str = "\
Fields for --set KEY=VALUE (defaults are the mixed scenario):
  workers=4 blocks=64 block_size=4096 reads=50 prepped=12 writes=20 min_blocks=4
  max_blocks=16 corrupt_metadata=2 dead_listener=1 unknown_connect=1 unknown_remote=2
  invalidated_remote=2 invalidated_before_post=1 invalidated_in_flight=1 remote_gone=1
  mismatched_descriptors=1 prepped_mismatched_indices=1 prepped_index_past_end=1
  gen_notifs=2 seed=1 md_wait_ms=2000 dead_listener_wait_ms=300 transfer_timeout_ms=5000
  notif_wait_ms=2000 in_flight_attempts=50 listener_delay_us=1000 progress_delay_us=100";

#[derive(Parser)]
#[command(
    name = "kvscope-nixl-lab",
    version,
    about = "Real NIXL 1.5.1 agents (UCX, DRAM) doing handshakes, KV block migrations and injected failures; prints the ground truth as JSON.",
    long_about = "Real NIXL 1.5.1 agents (the PyPI wheel nixl-cu12==1.5.1: libnixl.so + UCX plugin, through \
the nixl-sys crate) emulating decode workers: each agent has a KV block pool registered as DRAM, exchanges \
metadata with its ring neighbours (getLocalMD→loadRemoteMD, and over NIXL's socket listener: fetchRemoteMD, \
sendLocalMD), and migrates blocks (the target READs the source's blocks with a notification; some WRITEs). \
Failures are injected on demand. `run` prints the ground truth (every call a libnixl.so uprobe can see, its \
status, and totals) as JSON.\n\n\
Typical use:\n  kvscope-nixl-lab setup                      # once: download + unpack the wheel under <lab dir>/nixl\n  \
kvscope-nixl-lab libs                       # where libnixl.so is (attach uprobes here), JSON\n  \
eval \"$(kvscope-nixl-lab env)\"              # LD_LIBRARY_PATH + NIXL_PLUGIN_DIR for other programs\n  \
kvscope-nixl-lab run --scenario mixed       # ~70 transfers + handshakes + injected failures, truth on stdout\n  \
kvscope-nixl-lab run --processes --truth-out truth.json   # one process per agent\n  \
kvscope-nixl-lab bench --size 4096 --iters 20000          # WRITE loop, throughput JSON\n\n\
The binary re-executes itself with LD_LIBRARY_PATH (the wheel's libs folder) and NIXL_PLUGIN_DIR when \
started without them: nixl-sys dlopens libnixl_capi.so by name, and the loader reads LD_LIBRARY_PATH only at \
start-up. The lab dir is $KVSCOPE_LAB_DIR or <workspace>/.lab. NIXL logs its own errors (E… lines) on \
stderr; injected failures produce some; NIXL_LOG_LEVEL tunes them. Logs of the lab: KVSCOPE_LOG (default info)."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Args)]
struct LabDir {
    /// Lab directory (holds nixl/wheels and nixl/wheel).
    #[arg(long, env = "KVSCOPE_LAB_DIR")]
    lab_dir: Option<PathBuf>,
}

impl LabDir {
    fn path(&self) -> PathBuf {
        self.lab_dir
            .clone()
            .unwrap_or_else(kvscope_lab::paths::default_lab_dir)
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Download (pip download nixl-cu12==1.5.1 --no-deps) and unpack the wheel under
    /// <lab dir>/nixl if needed; prints where the libraries are. Idempotent.
    Setup {
        #[command(flatten)]
        lab: LabDir,
    },
    /// Print where the wheel's libraries are (JSON: lib_dir, plugin_dir, libnixl, build_id, …).
    Libs {
        #[command(flatten)]
        lab: LabDir,
    },
    /// Print `export LD_LIBRARY_PATH=… NIXL_PLUGIN_DIR=…` lines for a shell.
    Env {
        #[command(flatten)]
        lab: LabDir,
    },
    /// Run a scenario and print its ground truth (JSON).
    #[command(after_help = RUN_FIELDS_HELP)]
    Run(Box<RunArgs>),
    /// Transfer loop: N transfers of S bytes between two in-process agents; prints JSON
    /// with transfers/s, bytes/s and ns per transfer.
    Bench(BenchArgs),
    /// Serve migration directives: the workers as a long-running NIXL data plane
    /// (HTTP on 127.0.0.1, bearer token), each following its engine's KV events and
    /// publishing the blocks migrated to it. Prints one JSON line once up.
    Serve(ServeArgs),
    /// One worker as an engine's sidecar, for `serve --worker …,sidecar=FILE`: a NIXL
    /// agent and the engine's KV event publisher in this process (started inside the
    /// engine's process tree), driven by `serve` over a TCP control socket on loopback.
    /// Writes FILE (its control address, publisher and NIXL port) once up.
    Sidecar(SidecarArgs),
    /// (internal) One agent, driven over stdin/stdout by `run --processes`.
    #[command(hide = true)]
    Worker(WorkerArgs),
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    lab: LabDir,
    /// Preset: mixed (handshakes good and bad, 50 READ + 20 WRITE migrations, every
    /// failure injection) or clean (no injections).
    #[arg(long, default_value = "mixed")]
    scenario: String,
    /// Run each agent in its own process (default: all agents in this process).
    #[arg(long)]
    processes: bool,
    /// Write the truth here instead of stdout.
    #[arg(long)]
    truth_out: Option<PathBuf>,
    /// Pretty-print the JSON.
    #[arg(long)]
    pretty: bool,
    /// Kill the run (and its worker processes) after this many seconds.
    #[arg(long, default_value_t = 120)]
    deadline_secs: u64,
    /// Use the NIXL libraries in this folder (laid out like the wheel's
    /// .nixl_cu12.mesonpy.libs, bundled libs at ../nixl_cu12.libs) instead of the lab's.
    #[arg(long)]
    lib_dir: Option<PathBuf>,
    /// Map the NIXL libraries, then wait this long before the first NIXL call (lets a
    /// tracer that scans /proc/*/maps find the process first).
    #[arg(long, default_value_t = 0)]
    start_delay_ms: u64,
    /// Decode workers on the ring.
    #[arg(long)]
    workers: Option<u32>,
    /// READ migrations.
    #[arg(long)]
    reads: Option<u32>,
    /// WRITE migrations.
    #[arg(long)]
    writes: Option<u32>,
    /// Seed for block choices.
    #[arg(long)]
    seed: Option<u64>,
    /// Injection: loadRemoteMD of mangled metadata (fails with NIXL_ERR_MISMATCH).
    #[arg(long)]
    corrupt_metadata: Option<u32>,
    /// Injection: fetchRemoteMD from a port nobody listens on (metadata never arrives).
    #[arg(long)]
    dead_listener: Option<u32>,
    /// Injection: makeConnection to an unknown agent.
    #[arg(long)]
    unknown_connect: Option<u32>,
    /// Injection: transfers to an unknown remote agent name (fail at createXferReq).
    #[arg(long)]
    unknown_remote: Option<u32>,
    /// Injection: invalidateRemoteMD then a transfer (fails at createXferReq).
    #[arg(long)]
    invalidated_remote: Option<u32>,
    /// Injection: createXferReq, invalidateRemoteMD, postXferReq (fails at post).
    #[arg(long)]
    invalidated_before_post: Option<u32>,
    /// Injection: post (IN_PROG), invalidateRemoteMD, getXferStatus (fails at completion).
    #[arg(long)]
    invalidated_in_flight: Option<u32>,
    /// Injection: transfers to an agent destroyed after its metadata was loaded (fail at
    /// post with NIXL_ERR_REMOTE_DISCONNECT).
    #[arg(long)]
    remote_gone: Option<u32>,
    /// Any config field: --set key=value (repeatable; see the list below).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    lab: LabDir,
    /// Bytes per transfer.
    #[arg(long, default_value_t = 4096)]
    size: u64,
    /// Measured transfers.
    #[arg(long, default_value_t = 20_000)]
    iters: u32,
    /// Unmeasured transfers first.
    #[arg(long, default_value_t = 200)]
    warmup: u32,
    /// READ or WRITE.
    #[arg(long, default_value = "write", value_parser = parse_op)]
    op: Op,
    /// Descriptors per transfer (the bytes split evenly).
    #[arg(long, default_value_t = 1)]
    descs: u32,
    /// Attach a notification to every transfer.
    #[arg(long)]
    notif: bool,
    /// Create one request and repost it (no create/release per transfer).
    #[arg(long)]
    reuse_handle: bool,
    /// Pause of NIXL's progress thread between rounds, µs (0: it spins).
    #[arg(long, default_value_t = 100)]
    progress_delay_us: u64,
    /// Stop the loop after this many seconds.
    #[arg(long, default_value_t = 120)]
    max_secs: u64,
    /// Prefix of the two agents' names (`<prefix>initiator`, `<prefix>target`).
    #[arg(long, default_value = "bench-")]
    agent_prefix: String,
    /// Sleep this many ms before each transfer: not a measurement, a pair of agents kept
    /// alive and busy for tools attached later (the lab's worker sidecars).
    #[arg(long, default_value_t = 0)]
    pace_ms: u64,
    /// After the first post left in progress, wait this many ms before polling it: a
    /// transfer held in flight (not a measurement either).
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// Write the report here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Use the NIXL libraries in this folder instead of the lab's (see `run --lib-dir`).
    #[arg(long)]
    lib_dir: Option<PathBuf>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    lab: LabDir,
    /// A worker: `name=decode-0,worker_id=7[,dp_rank=0][,engine=tcp://127.0.0.1:5557]
    /// [,kv=tcp://127.0.0.1:0]` — the NIXL agent name, the engine (router worker id) it
    /// stands for, the engine's ZMQ KV event publisher to follow, and where to publish
    /// its own KV events. At least two.
    #[arg(long = "worker", required = true)]
    workers: Vec<kvscope_nixl_lab::serve::ServeWorker>,
    /// Address of the directive endpoint.
    #[arg(long, default_value = "127.0.0.1:9470")]
    listen: std::net::SocketAddr,
    /// File whose first line is the bearer token (else $KVSCOPE_NIXL_LAB_TOKEN; ≥ 16 chars).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Blocks per worker pool (half source blocks, half landing blocks).
    #[arg(long, default_value_t = 256)]
    blocks: u32,
    /// Bytes per KV block.
    #[arg(long, default_value_t = 4096)]
    block_size: u32,
    /// Exit after this many seconds (the lab stays bounded).
    #[arg(long, default_value_t = 3600)]
    deadline_secs: u64,
}

#[derive(Args)]
struct SidecarArgs {
    #[command(flatten)]
    lab: LabDir,
    /// NIXL agent name.
    #[arg(long)]
    name: String,
    /// Where to write the ready file.
    #[arg(long, value_name = "FILE")]
    ready_file: PathBuf,
    /// The worker's index among its peers: its pool's fill byte is 0x31 + INDEX, so a
    /// READ that lands a peer's bytes is told from one that did not happen.
    #[arg(long, default_value_t = 0)]
    index: u8,
    /// Control socket (the coordinator connects here).
    #[arg(long, default_value = "127.0.0.1:0")]
    control: String,
    /// The KV event publisher's bind address (vLLM's format).
    #[arg(long, default_value = "tcp://127.0.0.1:0")]
    kv_bind: String,
    /// Blocks in the pool (half source blocks, half landing blocks), as `serve --blocks`.
    #[arg(long, default_value_t = 256)]
    blocks: u32,
    /// Bytes per KV block, as `serve --block-size`.
    #[arg(long, default_value_t = 4096)]
    block_size: u32,
    /// Exit after this many seconds whatever happens.
    #[arg(long, default_value_t = 3600)]
    deadline_secs: u64,
}

#[derive(Args)]
struct WorkerArgs {
    #[arg(long)]
    name: String,
    #[arg(long)]
    listen_port: u16,
    #[arg(long)]
    blocks: u32,
    #[arg(long)]
    block_size: u32,
    #[arg(long)]
    fill: u8,
    #[arg(long, default_value_t = 1000)]
    listener_delay_us: u64,
    #[arg(long, default_value_t = 100)]
    progress_delay_us: u64,
    #[arg(long, default_value_t = 120)]
    deadline_secs: u64,
    #[arg(long, default_value_t = 0)]
    start_delay_ms: u64,
}

fn parse_op(s: &str) -> Result<Op, String> {
    match s.to_ascii_lowercase().as_str() {
        "read" => Ok(Op::Read),
        "write" => Ok(Op::Write),
        _ => Err(format!("expected read or write, got {s}")),
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVSCOPE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,nixl_sys=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Setup { lab } => {
            let libs = setup::ensure_wheel(&lab.path()).context("setting up the NIXL wheel")?;
            println!("{}", serde_json::to_string_pretty(&libs)?);
        }
        Cmd::Libs { lab } => {
            let libs = NixlLibs::locate(&lab.path())?;
            println!("{}", serde_json::to_string_pretty(&libs)?);
        }
        Cmd::Env { lab } => print!("{}", NixlLibs::locate(&lab.path())?.shell_exports()),
        Cmd::Run(args) => run_cmd(*args)?,
        Cmd::Bench(args) => bench_cmd(args)?,
        Cmd::Serve(args) => serve_cmd(args)?,
        Cmd::Sidecar(a) => {
            let libs = find_libs(&a.lab, None)?;
            ensure_env(&libs)?;
            let spec = WorkerSpec {
                name: a.name,
                listen_port: 0,
                blocks: a.blocks,
                block_size: a.block_size,
                fill: 0x31u8.wrapping_add(a.index),
                listener_delay_us: 1000,
                progress_delay_us: 100,
            };
            kvscope_nixl_lab::sidecar::serve(
                spec,
                &a.control,
                &a.kv_bind,
                &a.ready_file,
                Duration::from_secs(a.deadline_secs),
            )
            .map_err(anyhow::Error::msg)?;
        }
        Cmd::Worker(w) => {
            let spec = WorkerSpec {
                name: w.name,
                listen_port: w.listen_port,
                blocks: w.blocks,
                block_size: w.block_size,
                fill: w.fill,
                listener_delay_us: w.listener_delay_us,
                progress_delay_us: w.progress_delay_us,
            };
            let deadline = Duration::from_secs(w.deadline_secs);
            let delay = Duration::from_millis(w.start_delay_ms);
            worker::serve_stdio(spec, deadline, delay).map_err(anyhow::Error::msg)?;
        }
    }
    Ok(())
}

/// Re-executes this binary with the libraries' environment unless it already has it.
/// `exec` keeps the pid.
fn ensure_env(libs: &NixlLibs) -> Result<()> {
    if libs.env_ready() {
        return Ok(());
    }
    if std::env::var_os(REEXEC_MARKER_ENV).is_some() {
        bail!(
            "re-executed with LD_LIBRARY_PATH={} and NIXL_PLUGIN_DIR={} but they did not take",
            libs.lib_dir.display(),
            libs.plugin_dir.display()
        );
    }
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("finding this executable to re-execute it")?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(std::env::args_os().skip(1))
        .env(REEXEC_MARKER_ENV, "1");
    libs.apply_env(&mut cmd);
    let err = cmd.exec();
    Err(err).with_context(|| format!("re-executing {} with the NIXL environment", exe.display()))
}

fn watchdog(secs: u64) {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        eprintln!("kvscope-nixl-lab: deadline of {secs}s reached; exiting");
        std::process::exit(3);
    });
}

fn write_json<T: serde::Serialize>(value: &T, pretty: bool, out: Option<&Path>) -> Result<()> {
    let text = if pretty {
        serde_json::to_string_pretty(value)?
    } else {
        serde_json::to_string(value)?
    };
    match out {
        Some(path) => std::fs::write(path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?,
        None => println!("{text}"),
    }
    Ok(())
}

/// The scenario preset with the command line's overrides.
fn run_config(args: &RunArgs) -> Result<RunConfig> {
    let Some(mut config) = RunConfig::scenario(&args.scenario) else {
        bail!("unknown scenario {:?} (known: mixed, clean)", args.scenario);
    };
    let overrides = [
        (&mut config.workers, args.workers),
        (&mut config.reads, args.reads),
        (&mut config.writes, args.writes),
        (&mut config.corrupt_metadata, args.corrupt_metadata),
        (&mut config.dead_listener, args.dead_listener),
        (&mut config.unknown_connect, args.unknown_connect),
        (&mut config.unknown_remote, args.unknown_remote),
        (&mut config.invalidated_remote, args.invalidated_remote),
        (
            &mut config.invalidated_before_post,
            args.invalidated_before_post,
        ),
        (
            &mut config.invalidated_in_flight,
            args.invalidated_in_flight,
        ),
        (&mut config.remote_gone, args.remote_gone),
    ];
    for (field, value) in overrides {
        if let Some(v) = value {
            *field = v;
        }
    }
    if let Some(seed) = args.seed {
        config.seed = seed;
    }
    apply_sets(config, &args.set)
}

/// Applies `key=value` pairs to a config through its serde shape (unknown keys and
/// ill-typed values are refused).
fn apply_sets(config: RunConfig, sets: &[String]) -> Result<RunConfig> {
    if sets.is_empty() {
        return Ok(config);
    }
    let mut value = serde_json::to_value(&config)?;
    let map = value
        .as_object_mut()
        .context("config serializes as an object")?;
    for kv in sets {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--set needs KEY=VALUE, got {kv:?}");
        };
        if !map.contains_key(k) {
            bail!("--set: unknown config field {k:?}\n{RUN_FIELDS_HELP}");
        }
        let parsed =
            serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_string()));
        map.insert(k.to_string(), parsed);
    }
    serde_json::from_value(value).context("--set value has the wrong type")
}

/// The libraries: `--lib-dir` if given, else the lab dir's unpacked wheel.
fn find_libs(lab: &LabDir, lib_dir: Option<&Path>) -> Result<NixlLibs> {
    Ok(match lib_dir {
        Some(dir) => NixlLibs::from_lib_dir(dir)?,
        None => NixlLibs::locate(&lab.path())?,
    })
}

fn run_cmd(args: RunArgs) -> Result<()> {
    let libs = find_libs(&args.lab, args.lib_dir.as_deref())?;
    ensure_env(&libs)?;
    watchdog(args.deadline_secs);
    let config = run_config(&args)?;
    let scenario = if RunConfig::scenario(&args.scenario).as_ref() == Some(&config) {
        args.scenario.clone()
    } else {
        format!("{}+overrides", args.scenario)
    };
    let opts = RunOptions {
        scenario,
        config,
        mode: if args.processes {
            WorkerMode::Processes
        } else {
            WorkerMode::InProcess
        },
        libs,
        worker_exe: Some(
            std::env::current_exe().context("finding this executable for the worker processes")?,
        ),
        worker_deadline: Duration::from_secs(args.deadline_secs),
        start_delay: Duration::from_millis(args.start_delay_ms),
    };
    let truth = run::run(opts).context("running the NIXL lab")?;
    let s = &truth.summary;
    tracing::info!(
        transfers = s.transfers_total,
        status_polls = s.status_polls,
        notifications_received = s.notifications_received,
        wall_ms = truth.wall_ns / 1_000_000,
        "NIXL lab run finished."
    );
    write_json(&truth, args.pretty, args.truth_out.as_deref())?;
    let problems = truth.check();
    if !problems.is_empty() {
        bail!(
            "the truth is not self-consistent:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}

fn bench_cmd(args: BenchArgs) -> Result<()> {
    let libs = find_libs(&args.lab, args.lib_dir.as_deref())?;
    ensure_env(&libs)?;
    watchdog(args.max_secs + 60);
    let config = BenchConfig {
        size: args.size,
        iters: args.iters,
        warmup: args.warmup,
        op: args.op,
        descs: args.descs,
        notif: args.notif,
        reuse_handle: args.reuse_handle,
        progress_delay_us: args.progress_delay_us,
        max_secs: args.max_secs,
        agent_prefix: args.agent_prefix,
        pace_ms: args.pace_ms,
        hold_ms: args.hold_ms,
    };
    let report = bench::bench(config, &libs).context("running the bench loop")?;
    write_json(&report, false, args.out.as_deref())?;
    if report.failures > 0 {
        bail!("{} transfers failed", report.failures);
    }
    Ok(())
}

fn serve_cmd(args: ServeArgs) -> Result<()> {
    let libs = find_libs(&args.lab, None)?;
    ensure_env(&libs)?;
    watchdog(args.deadline_secs);
    let token = match &args.token_file {
        Some(p) => kvscope_kit::auth::read_token(p)
            .with_context(|| format!("reading the token file {}", p.display()))?,
        None => std::env::var("KVSCOPE_NIXL_LAB_TOKEN").unwrap_or_default(),
    };
    let cfg = kvscope_nixl_lab::serve::ServeConfig {
        workers: args.workers,
        listen: args.listen,
        token,
        blocks: args.blocks,
        block_size: args.block_size,
        listener_delay_us: 1000,
        progress_delay_us: 100,
    };
    let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    rt.block_on(async move {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
            let _ = stop_tx.send(true);
        });
        kvscope_nixl_lab::serve::serve(cfg, stop_rx).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_help_lists_every_config_field_with_its_default() {
        let value = serde_json::to_value(RunConfig::default()).unwrap();
        for (k, v) in value.as_object().unwrap() {
            let entry = format!("{k}={v}");
            assert!(
                RUN_FIELDS_HELP.contains(&entry),
                "RUN_FIELDS_HELP lacks {entry}"
            );
        }
    }

    #[test]
    fn sets_override_and_unknown_keys_fail() {
        let c = apply_sets(
            RunConfig::default(),
            &["reads=3".into(), "md_wait_ms=10".into()],
        )
        .unwrap();
        assert_eq!((c.reads, c.md_wait_ms), (3, 10));
        assert!(apply_sets(RunConfig::default(), &["nope=1".into()]).is_err());
        assert!(apply_sets(RunConfig::default(), &["reads=many".into()]).is_err());
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
