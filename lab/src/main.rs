//! `kvscope-lab`: a real Dynamo KV router (1.6.1, or another release) with mocker workers and NATS on
//! 127.0.0.1, and a multi-turn chat workload that makes the router spill.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use kvscope_lab::workload::{self, Api, PromptShape, WorkloadConfig};
use kvscope_lab::{paths, setup, Lab, LabConfig, Manifest};

#[derive(Parser)]
#[command(
    name = "kvscope-lab",
    version,
    about = "Run a real Dynamo KV router (1.6.1 unless --dynamo says) + mocker workers + NATS on 127.0.0.1, and a chat workload against it.",
    long_about = "Run a real Dynamo KV router (1.6.1, or the release --dynamo names) (dynamo.frontend --router-mode kv) with N dynamo.mocker \
workers and a nats-server -js, all on 127.0.0.1 with free ports, plus a bounded multi-turn chat \
workload that makes the router spill.\n\n\
Typical use:\n  kvscope-lab setup            # once: create the Python venv with Dynamo\n  \
kvscope-lab up               # start; prints the manifest (lab.json); Ctrl-C stops\n  \
kvscope-lab workload --frontend http://127.0.0.1:PORT\n  \
kvscope-lab run              # up + workload + down, prints the summary\n\n\
Everything lives under the lab dir ($KVSCOPE_LAB_DIR, default <workspace>/.lab): venv/ and runs/<id>/ \
with frontend.log (the router log), mocker-N.log, nats.log, discovery/ (DYN_FILE_KV) and lab.json."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create the lab venv of a Dynamo release (python3 -m venv + pip install ai-dynamo and
    /// what its wheel requires) if needed. Idempotent.
    Setup {
        /// Lab directory (holds venv/ and runs/).
        #[arg(long, env = "KVSCOPE_LAB_DIR")]
        lab_dir: Option<PathBuf>,
        /// The Dynamo release (repeatable): its venv is venv/ for the default release and
        /// dynamo-VERSION/venv/ for any other.
        #[arg(long = "dynamo", value_name = "VERSION", default_value = kvscope_lab::release::DEFAULT_DYNAMO)]
        dynamo: Vec<String>,
    },
    /// Start the lab and stay up until Ctrl-C; prints the manifest (JSON) on stdout.
    Up {
        #[command(flatten)]
        lab: LabArgs,
    },
    /// Run the chat workload against a running frontend; prints the summary (JSON).
    Workload {
        /// Frontend base URL, e.g. http://127.0.0.1:8000.
        #[arg(long)]
        frontend: String,
        #[command(flatten)]
        workload: Box<WorkloadArgs>,
        /// Write the full summary (every request) to this file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write the replies `--fixed-answers` plans for this workload, as the mockers'
    /// `--response-replay-trace-path` reads them (Mooncake JSONL).
    Answers {
        #[command(flatten)]
        workload: Box<WorkloadArgs>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Start the lab, run the workload, stop the lab; prints the summary (JSON).
    Run {
        #[command(flatten)]
        lab: LabArgs,
        #[command(flatten)]
        workload: Box<WorkloadArgs>,
        /// Write the full summary (every request) here (default: <run dir>/workload.json).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Stop a lab left running (e.g. after a crash), from its run dir's lab.json.
    Down {
        /// Run directory (containing lab.json) or the lab.json file.
        run_dir: PathBuf,
    },
}

#[derive(Args)]
struct LabArgs {
    /// Lab directory (holds venv/ and runs/).
    #[arg(long, env = "KVSCOPE_LAB_DIR")]
    lab_dir: Option<PathBuf>,
    /// The Dynamo release to run (its venv made by `setup --dynamo VERSION`; `run` and
    /// `up` make it when missing). A release before 1.6 has no DYN_EVENT_PLANE_HOST and
    /// needs --event-plane nats.
    #[arg(long = "dynamo", value_name = "VERSION", default_value = kvscope_lab::release::DEFAULT_DYNAMO)]
    dynamo: String,
    /// Run directory for logs, discovery store and lab.json (default: a fresh <lab dir>/runs/<id>).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Number of mocker workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// KV block size (tokens).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV capacity per worker in blocks (--num-gpu-blocks-override); small forces evictions.
    #[arg(long, default_value_t = 256)]
    num_gpu_blocks: u32,
    /// Mocker --speedup-ratio (higher = faster simulated engine).
    #[arg(long, default_value_t = 2.0)]
    speedup_ratio: f64,
    /// Disaggregated serving: this many prefill mockers beside the --workers, which then
    /// decode (--disaggregation-mode prefill / decode).
    #[arg(long, default_value_t = 0)]
    prefill_workers: usize,
    /// The prefill mockers' --speedup-ratio (default: --speedup-ratio).
    #[arg(long)]
    prefill_speedup_ratio: Option<f64>,
    /// Model directory (default: the committed fixture lab/fixtures/model).
    #[arg(long)]
    model_path: Option<PathBuf>,
    /// Served model name.
    #[arg(long, default_value = "kvscope-tiny")]
    model_name: String,
    /// Do not start nats-server.
    #[arg(long)]
    no_nats: bool,
    /// Run NATS without TLS and users (by default the bus is secured: TLS with the run's
    /// CA, a user per process; <run dir>/nats-security/<user>.env holds each kvscope
    /// user's KVSCOPE_NATS_* variables, e.g. `set -a; . kvscope-agent-lab-node.env`).
    #[arg(long)]
    open_bus: bool,
    /// An agent that gets a user on the secured bus, as AGENT_ID@CLUSTER (repeatable;
    /// default lab-node@lab).
    #[arg(long = "bus-agent", value_parser = parse_bus_agent)]
    bus_agents: Vec<kvscope_lab::bus_security::BusAgent>,
    /// Keep ANSI colours in the router log.
    #[arg(long)]
    ansi_logs: bool,
    /// DYN_LOG for the frontend.
    #[arg(long, default_value = "info,dynamo_kv_router=debug")]
    frontend_log: String,
    /// Extra argument for dynamo.frontend (repeatable), e.g. --frontend-arg=--router-track-output-blocks.
    #[arg(long = "frontend-arg", allow_hyphen_values = true)]
    frontend_args: Vec<String>,
    /// Extra argument for each dynamo.mocker (repeatable).
    #[arg(long = "mocker-arg", allow_hyphen_values = true)]
    mocker_args: Vec<String>,
    /// Seconds to wait for the lab to be ready.
    #[arg(long, default_value_t = 120.0)]
    startup_timeout: f64,
    /// Dynamo's discovery backend: file, or etcd (a real etcd on loopback).
    #[arg(long, value_enum, default_value_t = DiscoveryArg::File)]
    discovery: DiscoveryArg,
    /// Dynamo's event plane: zmq, or nats (the lab's NATS server).
    #[arg(long, value_enum, default_value_t = EventPlaneArg::Zmq)]
    event_plane: EventPlaneArg,
    /// Run the mockers without their KV replay sockets.
    #[arg(long)]
    no_replay: bool,
    /// The frontend writes Dynamo's request trace into its log (DYN_REQUEST_TRACE=1).
    #[arg(long)]
    request_trace: bool,
    /// The frontend logs JSON lines (DYN_LOGGING_JSONL=1): with them, kvscope's spans
    /// join the frontend's own traces.
    #[arg(long)]
    jsonl_logs: bool,
    /// The frontend exports its traces over OTLP/gRPC to this endpoint (e.g. a Tempo's
    /// http://127.0.0.1:4317), as service dynamo-frontend.
    #[arg(long, value_name = "URL")]
    frontend_otlp_traces: Option<String>,
    /// The frontend's wall clock reads this many ms off the host's (libfaketime):
    /// clock skew between the router and the engines, e.g. 100 or -100.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    frontend_clock_offset_ms: i64,
}

fn parse_bus_agent(s: &str) -> Result<kvscope_lab::bus_security::BusAgent, String> {
    match s.split_once('@') {
        Some((id, cluster)) if !id.is_empty() && !cluster.is_empty() => {
            Ok(kvscope_lab::bus_security::BusAgent::new(id, cluster))
        }
        _ => Err(format!(
            "{s:?}: expected AGENT_ID@CLUSTER, e.g. lab-node@lab"
        )),
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DiscoveryArg {
    File,
    Etcd,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum EventPlaneArg {
    Zmq,
    Nats,
}

impl LabArgs {
    fn config(&self) -> LabConfig {
        let d = LabConfig::default();
        LabConfig {
            lab_dir: self.lab_dir.clone().unwrap_or(d.lab_dir),
            dynamo: self.dynamo.clone(),
            run_dir: self.run_dir.clone(),
            model_path: self.model_path.clone().unwrap_or(d.model_path),
            model_name: self.model_name.clone(),
            workers: self.workers,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            speedup_ratio: self.speedup_ratio,
            prefill_workers: self.prefill_workers,
            prefill_speedup_ratio: self.prefill_speedup_ratio,
            nats: !self.no_nats,
            bus_security: !self.open_bus,
            bus_agents: if self.bus_agents.is_empty() {
                d.bus_agents.clone()
            } else {
                self.bus_agents.clone()
            },
            ansi_logs: self.ansi_logs,
            frontend_log_filter: self.frontend_log.clone(),
            frontend_args: self.frontend_args.clone(),
            mocker_args: self.mocker_args.clone(),
            startup_timeout_secs: self.startup_timeout,
            discovery: match self.discovery {
                DiscoveryArg::File => kvscope_lab::LabDiscovery::File,
                DiscoveryArg::Etcd => kvscope_lab::LabDiscovery::Etcd,
            },
            event_plane: match self.event_plane {
                EventPlaneArg::Zmq => kvscope_lab::LabEventPlane::Zmq,
                EventPlaneArg::Nats => kvscope_lab::LabEventPlane::Nats,
            },
            replay: !self.no_replay,
            request_trace: self.request_trace,
            frontend_otlp_traces: self.frontend_otlp_traces.clone(),
            frontend_jsonl_logs: self.jsonl_logs,
            frontend_clock_offset_ms: self.frontend_clock_offset_ms,
            ..d
        }
    }
}

#[derive(Args)]
struct WorkloadArgs {
    /// Seed for all generated content.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Conversation families (distinct system prompts).
    #[arg(long, default_value_t = 4)]
    families: usize,
    /// Conversations in total.
    #[arg(long, default_value_t = 24)]
    sessions: usize,
    /// Maximum requests in flight.
    #[arg(long, default_value_t = 12)]
    concurrency: usize,
    /// Maximum requests per second (0 = unlimited).
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Turns (requests) per conversation.
    #[arg(long, default_value_t = 4)]
    max_turns: usize,
    /// Stop sending new requests after this many seconds.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// max_tokens per request.
    #[arg(long, default_value_t = 48)]
    max_tokens: u32,
    /// Words (= tokens) in each family's system prompt (at least 256).
    #[arg(long, default_value_t = 320)]
    system_words: usize,
    /// Words (= tokens) per user turn.
    #[arg(long, default_value_t = 40)]
    user_words: usize,
    /// Endpoint: chat (/v1/chat/completions) or completions (/v1/completions).
    #[arg(long, value_enum, default_value_t = Api::Chat)]
    api: Api,
    /// Model name (default: the first one /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Pause between a reply and the next turn of the same conversation (ms).
    #[arg(long, default_value_t = 0)]
    think_time_ms: u64,
    /// Prefix of x-request-id values (default kvs<seed>).
    #[arg(long)]
    tag: Option<String>,
    /// Planned replies that come back as the same tokens in the next turn (the mockers
    /// must read `kvscope-lab answers`' trace: `run` sees to it; for `up`, pass
    /// --mocker-arg=--response-replay-trace-path --mocker-arg=<file>).
    #[arg(long)]
    fixed_answers: bool,
    /// Stream replies and record each one's time to first token (ttft_ms).
    #[arg(long)]
    stream: bool,
    /// Draw each family's system prompt length from --system-words ..= this (seeded).
    #[arg(long)]
    system_words_max: Option<usize>,
    /// Name each conversation's session (x-dynamo-session-id), as a frontend with
    /// --router-session-affinity-ttl-secs reads it.
    #[arg(long)]
    session_ids: bool,
    /// How prompts are shaped: uniform (every prompt alike) or long-tailed (shaped like
    /// production: log-uniform system prompts up to --system-words-max shared by
    /// popularity, --document-families documents, log-normal user turns).
    #[arg(long, value_enum, default_value_t = PromptShape::Uniform)]
    shape: PromptShape,
    /// Families whose system prompt is a document of --document-words (the last ones).
    #[arg(long, default_value_t = 0)]
    document_families: usize,
    /// Words (= tokens) in a document family's prompt.
    #[arg(long, default_value_t = 135_000)]
    document_words: usize,
    /// The longest user turn a long-tailed shape draws (words).
    #[arg(long, default_value_t = 8192)]
    user_words_max: usize,
}

impl WorkloadArgs {
    fn config(&self, frontend: &str) -> WorkloadConfig {
        WorkloadConfig {
            frontend: frontend.to_string(),
            model: self.model.clone(),
            api: self.api,
            seed: self.seed,
            families: self.families,
            sessions: self.sessions,
            concurrency: self.concurrency,
            rate: (self.rate > 0.0).then_some(self.rate),
            max_turns: self.max_turns,
            duration_secs: self.duration,
            max_tokens: self.max_tokens,
            system_words: self.system_words,
            user_words: self.user_words,
            think_time_ms: self.think_time_ms,
            tag: self.tag.clone(),
            fixed_answers: self.fixed_answers,
            stream: self.stream,
            system_words_max: self.system_words_max,
            session_ids: self.session_ids,
            shape: self.shape,
            document_families: self.document_families,
            document_words: self.document_words,
            user_words_max: self.user_words_max,
            ..WorkloadConfig::default()
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVSCOPE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Setup { lab_dir, dynamo } => {
            let lab_dir = lab_dir.unwrap_or_else(paths::default_lab_dir);
            for version in &dynamo {
                setup::ensure_release(&lab_dir, version)?;
            }
            setup::nats_server_path()?;
        }
        Cmd::Up { lab } => {
            let cfg = lab.config();
            setup::ensure_release(&cfg.lab_dir, &cfg.dynamo)?;
            let lab = Lab::start(cfg).await?;
            println!("{}", serde_json::to_string_pretty(lab.manifest())?);
            eprintln!(
                "Lab up (manifest {}). Ctrl-C to stop.",
                lab.manifest_path().display()
            );
            wait_for_shutdown().await;
            tokio::task::spawn_blocking(move || lab.stop()).await?;
        }
        Cmd::Workload {
            frontend,
            workload: w,
            out,
        } => {
            let summary = workload::run(w.config(&frontend)).await?;
            if let Some(out) = out {
                std::fs::write(&out, serde_json::to_vec_pretty(&summary)?)
                    .with_context(|| format!("writing {}", out.display()))?;
            }
            println!("{}", serde_json::to_string_pretty(&summary.brief())?);
            if summary.failed > 0 {
                std::process::exit(1);
            }
        }
        Cmd::Answers { workload: w, out } => {
            std::fs::write(&out, workload::answer_trace(&w.config("")))
                .with_context(|| format!("writing {}", out.display()))?;
        }
        Cmd::Run {
            lab,
            workload: w,
            out,
        } => {
            let mut cfg = lab.config();
            setup::ensure_release(&cfg.lab_dir, &cfg.dynamo)?;
            // Removed when this arm ends, however it ends.
            let _answers = if w.fixed_answers {
                let trace = workload::write_answer_trace(&w.config(""), &cfg.lab_dir)?;
                cfg = cfg.answering_from(trace.path());
                Some(trace)
            } else {
                None
            };
            let lab = Lab::start(cfg).await?;
            eprintln!("{}", serde_json::to_string_pretty(lab.manifest())?);
            let result = tokio::select! {
                r = workload::run(w.config(lab.frontend_url())) => Some(r),
                _ = wait_for_shutdown() => None,
            };
            let out = out.unwrap_or_else(|| lab.run_dir().join("workload.json"));
            let manifest = lab.manifest().clone();
            tokio::task::spawn_blocking(move || lab.stop()).await?;
            let Some(summary) = result else {
                anyhow::bail!("interrupted");
            };
            let summary = summary?;
            std::fs::write(&out, serde_json::to_vec_pretty(&summary)?)
                .with_context(|| format!("writing {}", out.display()))?;
            let mut brief = summary.brief();
            if let Some(o) = brief.as_object_mut() {
                o.insert("summary_file".into(), out.display().to_string().into());
                o.insert("manifest".into(), serde_json::to_value(&manifest)?);
            }
            println!("{}", serde_json::to_string_pretty(&brief)?);
            if summary.failed > 0 {
                std::process::exit(1);
            }
        }
        Cmd::Down { run_dir } => {
            let path = if run_dir.is_dir() {
                run_dir.join("lab.json")
            } else {
                run_dir
            };
            let manifest = Manifest::load(&path)?;
            let alive = Lab::stop_from_manifest(&manifest, Duration::from_secs(5));
            eprintln!("stopped {} process group(s): {alive:?}", alive.len());
        }
    }
    Ok(())
}

async fn wait_for_shutdown() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
