//! `kvscope`: the agent, the collector, the actuator and the what-if in one binary (the
//! image's). The demo on the embedded lab fleet is `kvscope-demo` (`fleet/`): nothing of
//! the lab is linked here.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Telemetry for KV-aware LLM serving fleets: spills, the true migratable delta, and
/// the data behind them.
#[derive(Parser)]
#[command(name = "kvscope", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the per-node agent (same as `kvscope-agent`).
    Agent(Box<kvscope_agent::cli::Cli>),
    /// Run the collector or write reports (same as `kvscope-collector`).
    Collector(kvscope_collector::cli::Cli),
    /// Flip KV migration OFF / DRY / LIVE from the collector's measurements, plan, audit
    /// (same as `kvscope-actuator`).
    #[command(long_about = kvscope_actuator::cli::LONG_ABOUT)]
    Actuator(kvscope_actuator::cli::Cli),
    /// Predict from a recording what a smaller KV cache per worker would do (same as
    /// `kvscope collector whatif`).
    #[command(long_about = kvscope_collector::cli::WHATIF_ABOUT)]
    Whatif(WhatifCli),
}

#[derive(Args)]
struct WhatifCli {
    /// The collector's TOML config file (its analyzer settings apply).
    #[arg(long, env = "KVSCOPE_COLLECTOR_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    log: kvscope_kit::LogArgs,
    #[command(flatten)]
    args: kvscope_collector::cli::WhatifArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match &cli.command {
        Command::Agent(c) => kvscope_kit::logging::init(c.log.log_format),
        Command::Collector(c) => kvscope_kit::logging::init(c.log.log_format),
        Command::Actuator(c) => kvscope_kit::logging::init(c.log.log_format),
        Command::Whatif(w) => kvscope_kit::logging::init(w.log.log_format),
    }
    let result = match cli.command {
        Command::Agent(cli) => kvscope_agent::cli::run(*cli).await,
        Command::Collector(cli) => kvscope_collector::cli::run(cli).await,
        Command::Actuator(cli) => kvscope_actuator::cli::run(cli).await,
        Command::Whatif(w) => kvscope_collector::cli::whatif_main(w.config.as_deref(), &w.args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
