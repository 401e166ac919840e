//! `kvscope-agent`: see [`kvscope_agent::cli`].

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match kvscope_agent::cli::run(kvscope_agent::cli::Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
