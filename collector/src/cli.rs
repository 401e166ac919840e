//! The collector's command line, shared by `kvscope-collector` and `kvscope collector`.

use crate::config::CollectorConfig;
use crate::fold::analyzer::FleetAnalyzer;
use crate::ingest::bus::{self, BusConfig};
use crate::report::OpportunityReport;
use crate::serve::api;
use crate::state::Shared;
use crate::supervise::{self, Essential};
use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use kvscope_wire::recording::RecordingWriter;
use kvscope_wire::Subjects;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::{error, info, warn};

/// Mirrors every worker's KV cache from the agents' records, measures spills and the true
/// migratable delta per request, and serves them as Prometheus metrics, a JSON API and
/// dry-run opportunity reports.
#[derive(Parser, Debug)]
#[command(name = "kvscope-collector", version, after_help = format!("{}\n\n{}", kvscope_otlp::HELP, kvscope_wire::nats_security::HELP))]
pub struct Cli {
    /// TOML config file (see docs/configure.md). KVSCOPE_COLLECTOR_*
    /// variables (one per field: `print-config` shows the result) and flags override it.
    #[arg(long, global = true, env = "KVSCOPE_COLLECTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    pub log: kvscope_kit::LogArgs,
    /// Window length in seconds (default 15).
    #[arg(long, global = true)]
    window_secs: Option<f64>,
    /// Warm-up after the first record whose windows are not measured, in seconds (default 15).
    #[arg(long, global = true)]
    warmup_secs: Option<f64>,
    /// Smallest gap between the best and chosen overlap, in blocks, that counts as a spill (default 1).
    #[arg(long, global = true)]
    min_spill_blocks: Option<u32>,
    /// Measure only these models (comma-separated; default every model): a large fleet
    /// is split across collectors by model on one stream. Models come from Dynamo's
    /// discovery, through the agents.
    #[arg(long, global = true, value_delimiter = ',')]
    models: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Consume records from NATS JetStream and serve /metrics and the JSON API until stopped.
    #[command(after_help = format!("{}\n\n{}", kvscope_otlp::HELP, kvscope_wire::nats_security::HELP))]
    Run {
        /// NATS server URL, or a cluster's servers separated by commas (default
        /// nats://127.0.0.1:4222).
        #[arg(long)]
        nats_url: Option<String>,
        /// Cluster name (default "default").
        #[arg(long)]
        cluster: Option<String>,
        /// Listen address for /metrics and /api (default 127.0.0.1:9465).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Record every applied record to this JSON-lines file (rewritten on each start).
        #[arg(long)]
        record: Option<PathBuf>,
        /// Write report.md, report.json and report.html here on shutdown.
        #[arg(long)]
        report_dir: Option<PathBuf>,
    },
    /// Print the effective configuration as TOML (defaults, file, environment, flags),
    /// secrets (OTLP headers) shown as <redacted>.
    PrintConfig,
    /// Write the dry-run opportunity report from a recording: Markdown, JSON, or one
    /// self-contained HTML page with plots (no scripts or assets fetched; opens offline).
    /// It ends with the what-if of the same requests (`whatif`'s inputs, same flags).
    Report {
        /// The recording to replay (from `run --record` or the agent's `--record`).
        #[arg(long)]
        replay: PathBuf,
        /// Write report.md, report.json and report.html into this folder instead of printing.
        #[arg(long)]
        out: Option<PathBuf>,
        /// What to print when --out is not given.
        #[arg(long, value_enum, default_value = "markdown")]
        format: Format,
        #[command(flatten)]
        whatif: crate::whatif::question::WhatIfInputs,
    },
    /// Predict from a recording what turning KV migration on would save net of its
    /// costs: a smaller KV cache per worker (the connector's reserve) against each spill's
    /// delta moved over NIXL.
    #[command(long_about = WHATIF_ABOUT)]
    Whatif(WhatifArgs),
}

/// `whatif --help`: every input and where it comes from.
pub const WHATIF_ABOUT: &str = "Predict from a recording what turning KV migration on \
would save on this fleet, net of its costs, and where conditional disaggregation pays \
off, and what another setting of the router would do. Four questions, one answer:

Capacity: the hit rate and uncached prefill tokens with each worker's cache --reserve \
smaller (the share NixlConnector's buffers would take).

Migration: each spill whose true delta reaches a token gate (--gate) moves that delta \
to the chosen worker, priced as the actuator prices a directive: one handshake + bytes \
/ the pair's NIXL bandwidth + a dispatch overhead, against recomputing the delta at the \
prefill rate; migrations slower than recomputing are not made. Per reserve and gate: \
migrations, bytes, NIXL seconds, and the prefill tokens and seconds saved net of the \
reserve's lost hits and the migrations' time; the break-even reserve, the best gate, and \
the actuator thresholds (min_tokens, min_true_delta_tok_per_s) to set at \
--connector-reserve.

Conditional disaggregation (with --ttft-samples): each path's time to first token, \
fitted from measured requests of both (prefill on the decode worker, or on a prefill \
worker with the KV handed over) as fixed + per-token × uncached tokens; the uncached \
size where they cross (the break-even), each threshold's share of requests kept local \
and predicted mean TTFT, and the frontend's --router-conditional-disagg-config for the \
break-even. Judged on the recording's requests (uncached = prompt − the chosen \
worker's cached prefix), or on the samples' own without --replay.

Router settings (--router, repeatable; --router-recorded for the recorded run's own): \
the recorded requests routed again by Dynamo 1.6.1's own load tracker \
(ActiveSequencesMultiWorker: each worker's active blocks and prefill tokens, booked \
when a request is routed, its prefill dropped at its first token, its blocks at its \
end) and its reference worker selector (DefaultWorkerSelector: the frontend's cost and \
picker, seeded, --router-runs runs per setting), over the simulated caches: spill \
rate, Σ true delta, hit rate, uncached prefill and the share of turns kept on their \
previous turn's worker per setting, beside the recorded run and the model at the \
recorded settings; and how far the model's load view is the router's own (each \
recorded decision's cost from the model's load against the logit the router logged). \
Each request's arrival, time to first token, end and output length come from Dynamo's \
request trace (DYN_REQUEST_TRACE=1 on the frontend; the agent reads it from the log; \
without it this question is not answered), and are held as recorded: a request sent \
elsewhere keeps its durations. Session affinity's sessions are the conversations the \
prompts show (a turn's prompt begins with its previous turn's whole prompt), as if \
clients named one session per conversation; a session's idle time counts from its last \
request's end. On a disaggregated fleet the judged decisions are the prefill pool's: a \
prefill worker holds a request until its first token, and affinity binds no prefill \
decision. At temperature 0 a lightly loaded fleet can settle into different routings \
from one run to the next: one recording predicts one of them.

Measured inputs, from the recording: every routed request (where it went, its prompt's \
blocks, what each worker held of them, judged by the same fold the live collector runs); \
each worker's KV cache in blocks (Dynamo's discovery, runtime_config.total_kv_blocks; or \
--gpu-blocks); NIXL bandwidth and mean handshake latency per pair of agents (the eBPF \
probes' reports, mapped to workers by the agents' process trees; fleet-wide where a pair \
was not measured; or --nixl-bandwidth-gbps, --handshake-ms). Given inputs: KV bytes per \
token (--kv-bytes-per-token, or --model-config with the model's config.json; default an \
8B model in fp16), the prefill rate (--prefill-tok-per-s, default 10000 tokens/s), the \
dispatch overhead (--dispatch-overhead-ms, default 5). The answer says which were \
defaults.

How: with nothing changed the figures are the recorded run's own (the recorded spills \
migrated: exact). With a reserve, each worker's cache is simulated as a \
least-recently-used cache of prompt blocks and the requests replayed over it in order, \
each going where it went (routing held fixed: a KV-aware router seeing other overlaps \
may choose otherwise, which the prediction does not follow). An engine's cache also \
holds decoded blocks and running requests' blocks, so the simulated size that \
reproduces the recorded hit rate is found first (the calibration, printed) and scaled \
by 1 - reserve.";

/// The what-if's inputs (see [`WHATIF_ABOUT`]).
#[derive(clap::Args, Debug)]
pub struct WhatifArgs {
    /// The recording to replay (from `run --record` or the agent's `--record`). Without
    /// it only conditional disaggregation is answered, from --ttft-samples.
    #[arg(long, required_unless_present = "ttft_samples")]
    pub replay: Option<PathBuf>,
    #[command(flatten)]
    pub inputs: crate::whatif::question::WhatIfInputs,
    /// What to print.
    #[arg(long, value_enum, default_value = "markdown")]
    pub format: WhatifFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum WhatifFormat {
    Markdown,
    Json,
}

/// Run the what-if of `args` with the analyzer settings of `cfg`.
pub fn whatif(cfg: &CollectorConfig, args: &WhatifArgs) -> anyhow::Result<()> {
    let disagg_only = |w: Option<&crate::whatif::WhatIf>| -> anyhow::Result<()> {
        let d = args
            .inputs
            .disagg(w)?
            .context("without a recording that answers, --ttft-samples is needed")?;
        print_answer(args.format, d.to_markdown(), &d)
    };
    let Some(replay) = &args.replay else {
        return disagg_only(None);
    };
    let w = crate::whatif::WhatIf::from_recording(replay, cfg.analyzer.clone())?;
    let what_if_on = || format!("what-if on {}", replay.display());
    match args.inputs.answer_for_report(&w).with_context(what_if_on)? {
        Ok(c) => print_answer(args.format, c.to_markdown(), &c),
        // What the recording lacks for the capacity and migration questions leaves
        // conditional disaggregation, where samples are given, still to answer.
        Err(why) if !args.inputs.ttft_samples.is_empty() => {
            eprintln!("{}: {why}; conditional disaggregation only", what_if_on());
            disagg_only(Some(&w))
        }
        Err(why) => anyhow::bail!("{}: {why}", what_if_on()),
    }
}

fn print_answer(
    format: WhatifFormat,
    markdown: String,
    json: &impl serde::Serialize,
) -> anyhow::Result<()> {
    match format {
        WhatifFormat::Markdown => print!("{markdown}"),
        WhatifFormat::Json => println!("{}", serde_json::to_string_pretty(json)?),
    }
    Ok(())
}

/// `kvscope whatif`: the config file (and environment) as the collector reads them.
pub fn whatif_main(config: Option<&Path>, args: &WhatifArgs) -> anyhow::Result<()> {
    let mut cfg: CollectorConfig = kvscope_kit::config::load_file(config)?;
    cfg.apply_env(|k| std::env::var(k).ok())
        .context("bad KVSCOPE_COLLECTOR_* variable")?;
    whatif(&cfg, args)
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    Markdown,
    Json,
    /// One self-contained HTML page with the plots.
    Html,
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let mut cfg: CollectorConfig = kvscope_kit::config::load_file(cli.config.as_deref())?;
    cfg.otlp
        .apply_env(|k| std::env::var(k).ok())
        .context("bad OTEL_* environment variable")?;
    cfg.nats
        .apply_env(|k| std::env::var(k).ok())
        .context("bad [nats] settings or KVSCOPE_NATS_* variable")?;
    cfg.apply_env(|k| std::env::var(k).ok())
        .context("bad KVSCOPE_COLLECTOR_* variable")?;
    if let Some(v) = cli.window_secs {
        cfg.analyzer.window_secs = v;
    }
    if let Some(v) = cli.warmup_secs {
        cfg.analyzer.warmup_secs = v;
    }
    if let Some(v) = cli.min_spill_blocks {
        cfg.analyzer.min_spill_blocks = v;
    }
    if !cli.models.is_empty() {
        cfg.analyzer.models = cli.models.clone();
    }
    anyhow::ensure!(
        cfg.analyzer.window_secs > 0.0,
        "window_secs must be positive"
    );
    match cli.command {
        Command::PrintConfig => {
            print!("{}", kvscope_kit::config::to_redacted_toml(&cfg)?);
            Ok(())
        }
        Command::Whatif(args) => whatif(&cfg, &args),
        Command::Report {
            replay: path,
            out,
            format,
            whatif,
        } => {
            let (a, w) = crate::whatif::WhatIf::replay_recording(&path, cfg.analyzer.clone())?;
            // What the recording lacks leaves the what-if out, saying why; a bad input is
            // an error.
            let answer = whatif
                .answer_for_report(&w)
                .with_context(|| format!("what-if on {}", path.display()))?;
            if let Err(why) = &answer {
                tracing::warn!(error = %why, "No what-if in the report.");
            }
            let report = OpportunityReport::from_analyzer(&a).with_whatif(answer);
            match out {
                Some(dir) => write_report(&dir, &report)?,
                None => match format {
                    Format::Markdown => print!("{}", report.to_markdown()),
                    Format::Json => println!("{}", report.to_json_pretty()),
                    Format::Html => print!("{}", report.to_html()),
                },
            }
            Ok(())
        }
        Command::Run {
            nats_url,
            cluster,
            listen,
            record,
            report_dir,
        } => {
            if let Some(v) = nats_url {
                cfg.nats_url = v;
            }
            if let Some(v) = cluster {
                cfg.cluster = v;
            }
            if let Some(v) = listen {
                cfg.listen = v;
            }
            if record.is_some() {
                cfg.record = record;
            }
            if report_dir.is_some() {
                cfg.report_dir = report_dir;
            }
            serve(cfg).await
        }
    }
}

async fn serve(cfg: CollectorConfig) -> anyhow::Result<()> {
    let recorder = match &cfg.record {
        Some(path) => {
            // The state is rebuilt from the stream at start, so the recording is too.
            std::fs::write(path, b"")
                .with_context(|| format!("cannot create recording {}", path.display()))?;
            Some(RecordingWriter::append(path)?)
        }
        None => None,
    };
    let shared = Shared::new(
        FleetAnalyzer::new(cfg.analyzer.clone()),
        recorder,
        Subjects::new(&cfg.cluster),
    );
    if cfg.lease_ttl_secs > 0 {
        // Nothing is served, exported or written as the scope's until the lease is held.
        crate::state::lock(&shared.bus).lease.role =
            kvscope_wire::api::summary::CollectorRole::Standby;
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (in use? pick another with --listen)",
                cfg.listen
            )
        })?;
    info!(listen = %listener.local_addr()?, "Serving /metrics and /api.");
    let app = api::router(shared.clone());
    let mut otlp = {
        let s = shared.clone();
        kvscope_otlp::OtlpExport::start(
            &cfg.otlp,
            kvscope_otlp::ServiceIdentity {
                name: "kvscope-collector",
                version: env!("CARGO_PKG_VERSION"),
                instance_id: format!(
                    "{}/{}",
                    kvscope_kit::host_name().as_deref().unwrap_or("unknown"),
                    cfg.durable_name
                ),
                attributes: vec![("kvscope.cluster".into(), cfg.cluster.clone())],
            },
            Arc::new(move || {
                crate::serve::metrics::exposition(&s, kvscope_kit::prom::Format::OpenMetrics)
            }),
            shared.otlp.clone(),
        )
        .context("cannot start OTLP export")?
    };
    if let Some(o) = &otlp {
        let _ = shared
            .applied
            .set(Box::new(crate::serve::spans::VerdictSpans(o.spans())));
    }
    let http = {
        let stats = shared.http.clone();
        tokio::spawn(async move {
            kvscope_kit::http::serve(listener, app, stats).await;
            anyhow::Ok(())
        })
    };
    // Limited to one model: only that model's subjects, on a durable consumer of its own
    // (another collector of the same stream, for the whole fleet or another model, has
    // its own too).
    let single_model = match cfg.analyzer.models.as_slice() {
        [m] => Some(m.as_str()),
        _ => None,
    };
    let durable_name = match single_model {
        Some(m) if cfg.durable_name == CollectorConfig::default().durable_name => {
            format!("{}-{}", cfg.durable_name, kvscope_wire::subject::token(m))
        }
        _ => cfg.durable_name.clone(),
    };
    let bus_cfg = BusConfig {
        nats_url: cfg.nats_url.clone(),
        security: cfg.nats.clone(),
        subjects: Subjects::new(&cfg.cluster),
        durable_name,
        stream_max_age: Duration::from_secs(cfg.stream_max_age_secs),
        stream_max_bytes: cfg.stream_max_bytes,
        stream_replicas: cfg.stream_replicas,
        filter: single_model.map(|m| Subjects::new(&cfg.cluster).of_model(m)),
        leader: None,
    };
    // Two collectors of one scope: the one holding the lease serves, the other stands by.
    let lease = (cfg.lease_ttl_secs > 0).then(|| crate::lease::LeaseConfig {
        bucket: bus_cfg.subjects.lease_bucket(),
        key: Subjects::lease_key(&bus_cfg.durable_name),
        identity: format!(
            "{}/{}",
            kvscope_kit::host_name().as_deref().unwrap_or("unknown"),
            cfg.listen
        ),
        ttl: Duration::from_secs(cfg.lease_ttl_secs),
        replicas: cfg.stream_replicas,
    });
    let mut essential = Vec::new();
    let bus_cfg = match &lease {
        Some(lease) => {
            let (leader, follows) = tokio::sync::watch::channel(false);
            essential.push(Essential::task(
                "lease",
                tokio::spawn(crate::lease::hold(
                    lease.clone(),
                    bus_cfg.clone(),
                    shared.clone(),
                    leader,
                )),
            ));
            BusConfig {
                leader: Some(follows),
                ..bus_cfg
            }
        }
        None => bus_cfg,
    };
    let bus_task = tokio::spawn(bus::run(bus_cfg.clone(), shared.clone()));
    let flusher = {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                shared.flush_recording();
            }
        })
    };
    essential.extend([
        Essential::task("bus reader", bus_task),
        Essential::task("HTTP server", http),
        Essential::task("recording flusher", flusher),
    ]);
    if let Some(o) = otlp.as_mut() {
        essential.push(Essential::owned_elsewhere("OTLP export", o.ended()));
    }
    let result = supervise::until_shutdown_or_first_end(essential, async {
        shutdown_signal().await;
        info!("Shutting down.");
    })
    .await;
    if result.is_err() {
        // main prints which task and why once the cleanup below is done.
        warn!("An essential task ended; the collector stops.");
    }
    shared.flush_recording();
    if let Some(o) = otlp {
        o.shutdown(Duration::from_secs(5)).await;
    }
    let served = crate::state::lock(&shared.bus).lease.role.serves();
    if let (Some(lease), true) = (&lease, served) {
        // Stopped cleanly: the standby need not wait for the lease to expire.
        let _ = tokio::time::timeout(
            Duration::from_secs(3),
            crate::lease::release(lease, &bus_cfg, shared.clone()),
        )
        .await;
    }
    // A standby's report would be the leader's again.
    if let (Some(dir), true) = (&cfg.report_dir, served) {
        let report = OpportunityReport::from_analyzer(&crate::state::lock(&shared.analyzer));
        if let Err(e) = write_report(dir, &report) {
            error!(error = %e, "Cannot write the report.");
        }
    }
    result
}

fn write_report(dir: &Path, report: &OpportunityReport) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(dir.join("report.md"), report.to_markdown())?;
    std::fs::write(dir.join("report.json"), report.to_json_pretty())?;
    std::fs::write(dir.join("report.html"), report.to_html())?;
    info!(dir = %dir.display(), "Wrote report.md, report.json and report.html.");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return ctrl_c.await.unwrap_or(()),
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
