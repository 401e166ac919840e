//! `kvscope-demo`: kvscope's main job on the embedded lab fleet. It starts Dynamo's KV
//! router with mocker workers and NATS on 127.0.0.1, attaches the `kvscope` agent and
//! collector (the binary beside this one), runs a bounded multi-turn chat workload,
//! prints the dry-run opportunity report and stops everything. `scripts/demo` builds
//! both and runs it; the `kvscope` binary itself carries no lab code.

use anyhow::Context as _;
use clap::Parser;
use kvscope_fleet::fleet_run::{FleetRun, FleetRunConfig};
use kvscope_lab::workload::{self, WorkloadConfig};
use kvscope_lab::LabConfig;
use std::path::PathBuf;
use std::time::Duration;

/// The demo's workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum DemoWorkload {
    /// Shaped like production traffic: 16 families of system prompts from 1k to 16k
    /// tokens (log-uniform), shared by popularity over 64 conversations, two of them
    /// 135k-token documents (past a 128k context); user turns log-normal around 128
    /// tokens up to 8k; 16,384 blocks per worker, so a document fits.
    Production,
    /// Small and uniform: 3 families of 320-token system prompts over 48 conversations,
    /// 40-token turns; 256 blocks per worker.
    Chat,
}

/// One workload's defaults: what each flag left out takes.
struct DemoDefaults {
    gpu_blocks: u32,
    sessions: usize,
    families: usize,
    concurrency: usize,
    rate: f64,
}

impl DemoWorkload {
    fn defaults(self) -> DemoDefaults {
        match self {
            DemoWorkload::Production => DemoDefaults {
                gpu_blocks: 16_384,
                sessions: 64,
                families: 16,
                concurrency: 32,
                rate: 10.0,
            },
            DemoWorkload::Chat => DemoDefaults {
                gpu_blocks: 256,
                sessions: 48,
                families: 3,
                concurrency: 32,
                rate: 20.0,
            },
        }
    }

    /// The workload's prompt shape on top of `wl`.
    fn shape(self, wl: WorkloadConfig) -> WorkloadConfig {
        match self {
            DemoWorkload::Production => WorkloadConfig {
                shape: workload::PromptShape::LongTailed,
                system_words: 1024,
                system_words_max: Some(16_384),
                document_families: 2,
                document_words: 135_000,
                user_words: 128,
                user_words_max: 8192,
                ..wl
            },
            DemoWorkload::Chat => wl,
        }
    }
}

/// The main job on the embedded lab fleet: start Dynamo's KV router with mocker workers
/// and NATS on 127.0.0.1, attach kvscope's agent and collector, run a bounded multi-turn
/// chat workload, print the dry-run opportunity report, stop everything.
#[derive(Parser)]
#[command(name = "kvscope-demo", version)]
struct DemoArgs {
    #[command(flatten)]
    log: kvscope_kit::LogArgs,
    /// The workload: `production` (long-tailed prompts, as an operator's fleet sees
    /// them) or `chat` (small uniform prompts). The flags below left out take its
    /// defaults.
    #[arg(long, value_enum, default_value_t = DemoWorkload::Production)]
    workload: DemoWorkload,
    /// Mocker workers.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// KV capacity per worker in blocks (default: the workload's, 16,384 for
    /// production, 256 for chat).
    #[arg(long)]
    gpu_blocks: Option<u32>,
    /// Softmax temperature of the router's worker choice (Dynamo's
    /// `--router-temperature`; 0 = deterministic). On this small lab, spills from load
    /// alone come and go with the machine's speed; 0.2 makes them certain.
    #[arg(long, default_value_t = 0.2)]
    router_temperature: f64,
    /// More arguments for Dynamo's frontend (repeatable), e.g.
    /// `--frontend-arg=--router-track-output-blocks` or
    /// `--frontend-arg=--router-session-affinity-ttl-secs --frontend-arg=30`.
    #[arg(long = "frontend-arg", allow_hyphen_values = true)]
    frontend_args: Vec<String>,
    /// Conversations in the workload (default: the workload's, 64 or 48).
    #[arg(long)]
    sessions: Option<usize>,
    /// Conversation families, distinct system prompts (default: the workload's, 16
    /// or 3).
    #[arg(long)]
    families: Option<usize>,
    /// Turns per conversation at most (the run is normally bounded by --duration-secs).
    #[arg(long, default_value_t = 40)]
    turns: usize,
    /// Requests in flight at most (default: the workload's, 32).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Request rate cap, requests/s (default: the workload's, 10 or 20).
    #[arg(long)]
    rate: Option<f64>,
    /// Stop sending new requests after this many seconds.
    #[arg(long, default_value_t = 60.0)]
    duration_secs: f64,
    /// Collector window length in seconds.
    #[arg(long, default_value_t = 5.0)]
    window_secs: f64,
    /// Warm-up not measured, in seconds.
    #[arg(long, default_value_t = 5.0)]
    warmup_secs: f64,
    /// Let the mockers answer with random tokens. By default each reply is planned from
    /// the workload's seed and the mockers answer with it, so the reply comes back as the
    /// same tokens in the next turn, as a real chat client sends it, and the blocks
    /// decode generated are part of the next prompt (the report's "true delta in
    /// decode-generated blocks").
    #[arg(long)]
    random_answers: bool,
    /// Name each conversation's session as Dynamo's frontend reads it for session
    /// affinity (the `x-dynamo-session-id` header), for a run with
    /// `--frontend-arg=--router-session-affinity-ttl-secs --frontend-arg=<secs>`.
    #[arg(long)]
    session_ids: bool,
    /// Write report.md, report.json, report.html and the recordings here (default: the lab
    /// run folder).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = DemoArgs::parse();
    // The demo says each step in one line of its own; the lab's and the bus client's INFO
    // lines would bury them (RUST_LOG=info shows them).
    kvscope_kit::logging::init_at(args.log.log_format, "warn");
    match demo(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-demo: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The `kvscope` binary the agent and collector run as: the one built beside this one.
fn kvscope_binary() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("cannot find the kvscope-demo binary itself")?;
    let exe = me.with_file_name("kvscope");
    anyhow::ensure!(
        exe.is_file(),
        "no kvscope binary beside {} (build both: cargo build -p kvscope -p kvscope-fleet; \
         scripts/demo does)",
        me.display()
    );
    Ok(exe)
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let d = args.workload.defaults();
    let sessions = args.sessions.unwrap_or(d.sessions);
    let rate = args.rate.unwrap_or(d.rate);
    let mut wl = args.workload.shape(WorkloadConfig {
        sessions,
        families: args.families.unwrap_or(d.families),
        max_turns: args.turns,
        concurrency: args.concurrency.unwrap_or(d.concurrency),
        rate: Some(rate),
        duration_secs: args.duration_secs,
        fixed_answers: !args.random_answers,
        session_ids: args.session_ids,
        ..WorkloadConfig::default()
    });
    let mut lab = LabConfig {
        workers: args.workers,
        num_gpu_blocks: args.gpu_blocks.unwrap_or(d.gpu_blocks),
        frontend_args: [
            "--router-temperature".to_string(),
            args.router_temperature.to_string(),
        ]
        .into_iter()
        .chain(args.frontend_args.iter().cloned())
        .collect(),
        // Each request's timing, which the what-if's router model books load by.
        request_trace: true,
        ..LabConfig::default()
    };
    eprintln!(
        "kvscope-demo: checking the lab venv in {} …",
        lab.lab_dir.display()
    );
    kvscope_lab::setup::ensure_venv(&lab.lab_dir)?;
    // Removed when the demo ends, however it ends (a copy goes beside the report).
    let answers = if wl.fixed_answers {
        let trace = workload::write_answer_trace(&wl, &lab.lab_dir)?;
        lab = lab.answering_from(trace.path());
        Some(trace)
    } else {
        None
    };
    let lab_frontend_args = lab.frontend_args.clone();
    eprintln!(
        "kvscope-demo: starting the lab ({} mocker workers) with the agent and collector …",
        args.workers
    );
    let exe = kvscope_binary()?;
    let mut run = FleetRun::start(
        &exe,
        FleetRunConfig {
            warmup_secs: args.warmup_secs,
            ..FleetRunConfig::new(lab, args.window_secs)
        },
    )
    .await?;
    eprintln!(
        "kvscope-demo: collector API at {} (try {}/api/report.md)",
        run.api(),
        run.api()
    );
    wl.frontend = run.lab().frontend_url().to_string();
    eprintln!(
        "kvscope-demo: running the {:?} workload ({} sessions × {} turns, ≤ {} req/s, ≤ {} s) …",
        args.workload, sessions, args.turns, rate, args.duration_secs
    );
    let summary = workload::run(wl).await?;
    eprintln!(
        "kvscope-demo: workload done: {} sent, {} ok, {} failed in {:.1} s",
        summary.sent, summary.ok, summary.failed, summary.elapsed_secs
    );
    // The agent stops first, releasing what it still holds (a request trace's
    // decisions wait out their window), so the collector applies everything.
    run.stop_agent().await;
    run.wait_drained(Duration::from_secs(2), Duration::from_secs(60))
        .await?;
    let report = run.report().await?;
    let out = args
        .out
        .unwrap_or_else(|| run.lab().run_dir().to_path_buf());
    // The what-if of the run's requests, from its whole recording once the collector
    // has flushed it: the report's last section.
    let recording = run.recording.clone();
    run.stop();
    eprintln!("kvscope-demo: the what-if on the recording (half a minute or so) …");
    let cfg = kvscope_collector::fold::analyzer::AnalyzerConfig {
        window_secs: args.window_secs,
        warmup_secs: args.warmup_secs,
        ..Default::default()
    };
    // The router's own settings, as the demo started it: the model's recorded run.
    let router_recorded =
        kvscope_collector::whatif::router::RouterSettings::change_from_frontend_args(
            &lab_frontend_args,
        );
    let whatif = match kvscope_collector::whatif::WhatIf::from_recording(&recording, cfg) {
        Ok(w) => kvscope_collector::whatif::question::WhatIfInputs {
            router_recorded: Some(router_recorded),
            ..Default::default()
        }
        .answer_for_report(&w)?,
        Err(e) => Err(e.to_string()),
    };
    let report = report.with_whatif(whatif);
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("report.md"), report.to_markdown())?;
    std::fs::write(out.join("report.json"), report.to_json_pretty())?;
    std::fs::write(out.join("report.html"), report.to_html())?;
    std::fs::write(
        out.join("workload.json"),
        serde_json::to_vec_pretty(&summary)?,
    )?;
    if let Some(trace) = &answers {
        // The replies the mockers were given, beside the workload that asked for them.
        std::fs::copy(trace.path(), out.join("answers.jsonl"))?;
    }
    // The recording beside the report it was made from (`kvscope whatif --replay` and
    // `kvscope collector report --replay` take it).
    let kept = out.join("collector-recording.jsonl");
    if kept != recording {
        std::fs::copy(&recording, &kept)?;
    }
    println!("{}", report.to_markdown());
    if let Some(router_view) = summary.router_spilled_cached_tokens {
        let kvscope_view: u64 = report.windows.iter().map(|w| w.true_delta_tokens).sum();
        println!(
            "Cross-check, whole run including warm-up: Dynamo's own router counters put the \
             cached prefix it passed over (best − selected) at {router_view:.0} tokens; \
             kvscope's true delta over the same closed windows is {kvscope_view} tokens."
        );
    }
    eprintln!(
        "kvscope-demo: report.md, report.json, report.html, workload.json, {}\
         collector-recording.jsonl in {}",
        if answers.is_some() {
            "answers.jsonl (the planned replies), "
        } else {
            ""
        },
        out.display(),
    );
    Ok(())
}
