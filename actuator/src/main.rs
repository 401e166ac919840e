//! `kvscope-actuator`: OFF / DRY / LIVE for the router's KV migration, from measurements.

use clap::Parser as _;
use kvscope_actuator::cli::{run, Cli};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    kvscope_kit::logging::init(cli.log.log_format);
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-actuator: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
