//! `kvscope-actuator`: OFF / DRY / LIVE for the router's KV migration, from measurements.

use clap::Parser as _;
use kvscope_actuator::cli::{run, Cli};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-actuator: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
