//! `kvscope-bench`: kvscope's fleet mirror against every exact indexer of
//! `dynamo-kv-router` 1.6.1 on the same stream of KV events and routing queries, and
//! kvscope's mirror at fleet scale. See BENCHMARKS.md for the figures and how to read
//! them.
//!
//! Each (contender, input) pair runs in a fresh child process of this binary, twice:
//! once for time and resident memory, once with the counting allocator on for live heap
//! bytes. The parent builds the same input, replays it through kvscope in-process to get
//! the reference answers and the number of cached (block, worker) pairs, and compares
//! every child's answers to them query by query.

mod compare;
mod contenders;
mod floor;
mod freshness;
mod measure;
mod scale;
mod synthetic;
mod trace;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: measure::CountingAlloc = measure::CountingAlloc;

#[derive(Parser)]
#[command(name = "kvscope-bench", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// kvscope vs every Dynamo indexer on (a) a lab recording and (b) the synthetic
    /// fleet trace; prints block ops/s, query latency and bytes per cached (block,
    /// worker) for each, and the ratios kvscope / best Dynamo indexer.
    Compare(compare::CompareArgs),
    /// kvscope's mirror at fleet scale (default 1,000 workers × 50,000 blocks each):
    /// resident memory and query latency.
    Scale(scale::ScaleArgs),
    /// Freshness through the real pipeline (load generator → `kvscope agent` → NATS
    /// JetStream → `kvscope collector`): the delay from a KV event's publish to the
    /// verdict that depends on it being available, p50/p99, at a sustained block rate.
    Freshness(freshness::FreshnessArgs),
    /// What one cache miss to memory costs on this machine, alone and with several in
    /// flight: the floor the mirror's events per block are read against (BENCHMARKS.md,
    /// "What bounds it").
    Floor(floor::FloorArgs),
    /// One contender on one input (run by `compare` in a child process).
    #[command(hide = true)]
    RunOne(compare::RunOneArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Compare(args) => compare::compare(args),
        Command::Scale(args) => scale::scale(args),
        Command::Freshness(args) => freshness::freshness(args),
        Command::Floor(args) => floor::floor(args),
        Command::RunOne(args) => compare::run_one(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvscope-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
