//! `kvscope-collector`: the fleet view of kvscope.

use clap::Parser as _;
use kvscope_collector::cli::{run, Cli};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    kvscope_kit::logging::init(cli.log.log_format);
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-collector: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
