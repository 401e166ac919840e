//! `kvscope-collector`: the fleet view of kvscope.

use clap::Parser as _;
use kvscope_collector::cli::{run, Cli};

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
            eprintln!("kvscope-collector: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
