//! `kvscope-agent`: see [`kvscope_agent::cli`].

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = kvscope_agent::cli::Cli::parse();
    kvscope_kit::logging::init(cli.log.log_format);
    match kvscope_agent::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
