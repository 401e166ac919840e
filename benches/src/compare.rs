//! `compare`: every contender on every input, one child process per measurement, and
//! the report.

use crate::contenders::{
    describe, Contender, DynamoAsync, DynamoPositional, DynamoRadixTree, DynamoThreadPool, Kvscope,
    CONTENDERS,
};
use crate::measure::{self, quantile, replay};
use crate::synthetic::{fleet_trace, FleetSpec};
use crate::trace::Trace;
use anyhow::Context as _;
use dynamo_kv_router::indexer::positional::SearchMode;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Stdio;

#[derive(clap::Args)]
pub struct CompareArgs {
    /// A lab recording (JSONL of `Envelope`): the collector's `--record` file, e.g.
    /// `.lab/runs/<run>/collector-recording.jsonl` after `kvscope-demo`. Without it only
    /// the synthetic input runs.
    #[arg(long)]
    recording: Option<PathBuf>,
    /// Skip the synthetic fleet trace.
    #[arg(long)]
    no_synthetic: bool,
    /// Contenders, comma-separated (default: all). `kvscope` is always run.
    #[arg(long, value_delimiter = ',')]
    contenders: Vec<String>,
    /// Replays of the recording in each child (it is small); the median replay counts.
    #[arg(long, default_value_t = 30)]
    recording_repeat: u32,
    /// Replays of the synthetic trace in each child; the median replay counts.
    #[arg(long, default_value_t = 1)]
    synthetic_repeat: u32,
    /// Timing children per contender and input (round-robin over the contenders); the
    /// median run is shown.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Skip the second child per contender that counts live heap bytes.
    #[arg(long)]
    no_heap: bool,
    #[command(flatten)]
    fleet: FleetSpec,
    /// Also write the report (markdown) to this file.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct RunOneArgs {
    #[arg(long)]
    contender: String,
    /// The recording; without it, the synthetic trace of `--fleet-json`.
    #[arg(long)]
    recording: Option<PathBuf>,
    #[arg(long)]
    fleet_json: Option<String>,
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    #[arg(long)]
    count_allocations: bool,
}

/// What a child reports.
#[derive(Debug, Serialize, Deserialize)]
pub struct RunReport {
    pub contender: String,
    /// Per replay: time in apply + query, in apply, in query.
    pub total_ns: Vec<u64>,
    pub apply_ns: Vec<u64>,
    pub query_ns: Vec<u64>,
    /// Query latency over all replays.
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    /// Resident-set growth over the first replay (the structure, its threads and the
    /// allocator's retention of what it freed).
    pub rss_delta: i64,
    /// Live heap growth over the first replay (with `--count-allocations`).
    pub heap_delta: Option<i64>,
    /// Answer digests of the first replay.
    pub digests: Vec<u64>,
}

#[derive(Clone)]
enum Input {
    Recording(PathBuf),
    Synthetic(FleetSpec),
}

impl Input {
    fn build(&self) -> anyhow::Result<(Trace, Option<u64>)> {
        Ok(match self {
            Input::Recording(path) => (Trace::from_recording(path)?, None),
            Input::Synthetic(spec) => {
                let (trace, pairs) = fleet_trace(spec);
                (trace, Some(pairs))
            }
        })
    }

    fn child_args(&self) -> anyhow::Result<Vec<String>> {
        Ok(match self {
            Input::Recording(path) => vec!["--recording".into(), path.display().to_string()],
            Input::Synthetic(spec) => vec!["--fleet-json".into(), serde_json::to_string(spec)?],
        })
    }
}

pub fn run_one(args: RunOneArgs) -> anyhow::Result<()> {
    if args.count_allocations {
        measure::start_counting();
    }
    let input = match (&args.recording, &args.fleet_json) {
        (Some(path), _) => Input::Recording(path.clone()),
        (None, Some(json)) => Input::Synthetic(serde_json::from_str(json)?),
        (None, None) => anyhow::bail!("--recording or --fleet-json"),
    };
    let (trace, _) = input.build()?;
    let repeat = args.repeat.max(1);
    let counting = args.count_allocations;
    let report = match args.contender.as_str() {
        "kvscope" => run(&trace, repeat, counting, Kvscope::new),
        "dynamo-radix-tree" => run(&trace, repeat, counting, DynamoRadixTree::new),
        "dynamo-positional" => run(&trace, repeat, counting, || {
            DynamoPositional::new(SearchMode::Strided)
        }),
        "dynamo-positional-binary" => run(&trace, repeat, counting, || {
            DynamoPositional::new(SearchMode::Binary)
        }),
        "dynamo-crtc-1" => run(&trace, repeat, counting, || DynamoThreadPool::crtc(1)),
        "dynamo-crtc-4" => run(&trace, repeat, counting, || DynamoThreadPool::crtc(4)),
        "dynamo-positional-tp-1" => {
            run(&trace, repeat, counting, || DynamoThreadPool::positional(1))
        }
        "dynamo-kv-indexer" => run(&trace, repeat, counting, DynamoAsync::kv_indexer),
        "dynamo-branch-sharded" => run(&trace, repeat, counting, || {
            DynamoAsync::branch_sharded(2, 1, 1)
        }),
        other => anyhow::bail!("unknown contender {other:?}"),
    };
    let report = RunReport {
        contender: args.contender,
        ..report
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn run<C: Contender>(
    trace: &Trace,
    repeat: u32,
    counting: bool,
    make: impl Fn() -> C,
) -> RunReport {
    let (h0, r0) = (measure::live_heap(), measure::rss_bytes());
    let mut c = make();
    let first = replay(&mut c, trace);
    // The replay's own record (latencies, digests) is not the contender's.
    let record = ((first.latencies_ns.capacity() + first.digests.capacity()) * 8) as i64;
    let heap_delta = counting.then(|| (measure::live_heap() - h0) as i64 - record);
    let rss_delta = measure::rss_bytes() as i64 - r0 as i64 - record;
    drop(c);
    let mut replays = vec![first];
    for _ in 1..repeat {
        let mut c = make();
        replays.push(replay(&mut c, trace));
    }
    let latencies: Vec<u64> = replays
        .iter()
        .flat_map(|r| r.latencies_ns.iter().copied())
        .collect();
    RunReport {
        contender: String::new(),
        total_ns: replays
            .iter()
            .map(|r| r.total().as_nanos() as u64)
            .collect(),
        apply_ns: replays.iter().map(|r| r.apply.as_nanos() as u64).collect(),
        query_ns: replays.iter().map(|r| r.query.as_nanos() as u64).collect(),
        p50_ns: quantile(&latencies, 0.5),
        p99_ns: quantile(&latencies, 0.99),
        max_ns: latencies.iter().copied().max().unwrap_or(0),
        rss_delta,
        heap_delta,
        digests: std::mem::take(&mut replays[0].digests),
    }
}

fn child(
    contender: &str,
    input: &Input,
    repeat: u32,
    count_allocations: bool,
) -> anyhow::Result<RunReport> {
    let exe = std::env::current_exe().context("cannot find kvscope-bench itself")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["run-one", "--contender", contender, "--repeat"])
        .arg(repeat.to_string())
        .args(input.child_args()?)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if count_allocations {
        cmd.arg("--count-allocations");
    }
    let out = cmd.output().context("cannot run the child")?;
    anyhow::ensure!(
        out.status.success(),
        "{contender}: the child failed ({})",
        out.status
    );
    serde_json::from_slice(&out.stdout).with_context(|| format!("{contender}: unreadable report"))
}

/// One row of the report.
struct Row {
    contender: String,
    block_ops_per_s: f64,
    apply_ns_per_block: f64,
    query_blocks_per_s: f64,
    p50_ns: u64,
    p99_ns: u64,
    heap_per_pair: Option<f64>,
    rss_per_pair: f64,
    mismatches: usize,
}

fn median(v: &[u64]) -> u64 {
    quantile(v, 0.5)
}

pub fn compare(args: CompareArgs) -> anyhow::Result<()> {
    let mut names: Vec<String> = if args.contenders.is_empty() {
        CONTENDERS.iter().map(|(n, _)| n.to_string()).collect()
    } else {
        args.contenders.clone()
    };
    if !names.iter().any(|n| n == "kvscope") {
        names.insert(0, "kvscope".into());
    }
    for n in &names {
        anyhow::ensure!(
            CONTENDERS.iter().any(|(c, _)| c == n),
            "unknown contender {n:?}"
        );
    }
    let mut inputs = Vec::new();
    if let Some(path) = &args.recording {
        inputs.push((Input::Recording(path.clone()), args.recording_repeat));
    }
    if !args.no_synthetic {
        inputs.push((Input::Synthetic(args.fleet.clone()), args.synthetic_repeat));
    }
    anyhow::ensure!(!inputs.is_empty(), "nothing to run");

    let mut md = String::new();
    writeln!(md, "{}", machine())?;
    print!("{md}");
    for (input, repeat) in &inputs {
        let section = compare_input(input, *repeat, args.runs.max(1), &names, !args.no_heap)?;
        print!("{section}");
        md.push_str(&section);
    }
    writeln!(md, "\nContenders:\n")?;
    for n in &names {
        writeln!(md, "- `{n}`: {}", describe(n))?;
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, &md).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn compare_input(
    input: &Input,
    repeat: u32,
    runs: u32,
    names: &[String],
    heap: bool,
) -> anyhow::Result<String> {
    let (trace, generator_pairs) = input.build()?;
    // The reference: kvscope in this process, once, for the answers and the pair count.
    let mut reference = Kvscope::new();
    let reference_replay = replay(&mut reference, &trace);
    let pairs = reference.index().cached_pairs() as u64;
    if let Some(g) = generator_pairs {
        anyhow::ensure!(
            g == pairs,
            "the generator left {g} cached pairs, kvscope's mirror {pairs}"
        );
    }
    let s = trace.stats.clone();
    let mut out = String::new();
    writeln!(out, "\n## {}\n", trace.name)?;
    writeln!(
        out,
        "{} workers; {} store events ({} blocks), {} remove events ({} blocks), {} clears, \
         {} queries ({} blocks): {} block ops. At the end {} (block, worker) pairs are cached. \
         Stream: {:.1} MB, not counted in any figure. {} replay(s) per child, {} timing \
         child(ren) per contender, medians shown.\n",
        s.workers,
        s.store_events,
        s.stored_blocks,
        s.remove_events,
        s.removed_blocks,
        s.clears,
        s.queries,
        s.query_blocks,
        s.block_ops(),
        pairs,
        trace.heap_bytes() as f64 / 1e6,
        repeat,
        runs,
    )?;
    drop(trace);

    // Timing children go round-robin over the contenders, `runs` times, so that a change
    // in the machine's load (other work on a shared box) hits every contender alike; each
    // figure is the median over the runs.
    let mut timed: Vec<Vec<RunReport>> = names.iter().map(|_| Vec::new()).collect();
    for run in 0..runs {
        for (name, reports) in names.iter().zip(&mut timed) {
            eprintln!("kvscope-bench: {name} (run {}/{runs}) …", run + 1);
            reports.push(child(name, input, repeat, false)?);
        }
    }
    let mut rows: Vec<Row> = Vec::new();
    for (name, reports) in names.iter().zip(&timed) {
        let counted = if heap {
            eprintln!("kvscope-bench: {name} (live heap) …");
            Some(child(name, input, 1, true)?)
        } else {
            None
        };
        let med = |f: fn(&RunReport) -> u64| median(&reports.iter().map(f).collect::<Vec<_>>());
        let total = med(|r| median(&r.total_ns)) as f64 / 1e9;
        let apply = med(|r| median(&r.apply_ns)) as f64;
        let query = med(|r| median(&r.query_ns)) as f64 / 1e9;
        let first = &reports[0];
        let mismatches = first
            .digests
            .iter()
            .zip(&reference_replay.digests)
            .filter(|(a, b)| a != b)
            .count()
            + first.digests.len().abs_diff(reference_replay.digests.len());
        rows.push(Row {
            contender: name.clone(),
            block_ops_per_s: s.block_ops() as f64 / total,
            apply_ns_per_block: apply / (s.stored_blocks + s.removed_blocks).max(1) as f64,
            query_blocks_per_s: s.query_blocks as f64 / query,
            p50_ns: med(|r| r.p50_ns),
            p99_ns: med(|r| r.p99_ns),
            heap_per_pair: counted
                .and_then(|c| c.heap_delta)
                .map(|h| h as f64 / pairs.max(1) as f64),
            rss_per_pair: med(|r| r.rss_delta.max(0) as u64) as f64 / pairs.max(1) as f64,
            mismatches,
        });
    }

    writeln!(
        out,
        "| contender | block ops/s | events ns/block | query blocks/s | query p50 | query p99 \
         | heap B/pair | RSS B/pair | answers ≠ kvscope |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for r in &rows {
        writeln!(
            out,
            "| `{}` | {:.2} M | {:.0} | {:.1} M | {:.1} µs | {:.1} µs | {} | {:.0} | {} |",
            r.contender,
            r.block_ops_per_s / 1e6,
            r.apply_ns_per_block,
            r.query_blocks_per_s / 1e6,
            r.p50_ns as f64 / 1e3,
            r.p99_ns as f64 / 1e3,
            r.heap_per_pair.map_or("–".into(), |h| format!("{h:.0}")),
            r.rss_per_pair,
            r.mismatches,
        )?;
    }
    let kv = rows.iter().find(|r| r.contender == "kvscope");
    let dynamo: Vec<&Row> = rows
        .iter()
        .filter(|r| r.contender.starts_with("dynamo"))
        .collect();
    if let (Some(kv), Some(best)) = (
        kv,
        dynamo
            .iter()
            .max_by(|a, b| a.block_ops_per_s.total_cmp(&b.block_ops_per_s)),
    ) {
        writeln!(out)?;
        writeln!(
            out,
            "- throughput: kvscope / fastest Dynamo indexer (`{}`) = **{:.2}×** (target ≥ 2×)",
            best.contender,
            kv.block_ops_per_s / best.block_ops_per_s
        )?;
        let best_p50 = dynamo.iter().map(|r| r.p50_ns).min().unwrap_or(0);
        let best_p99 = dynamo.iter().map(|r| r.p99_ns).min().unwrap_or(0);
        writeln!(
            out,
            "- query latency: best Dynamo p50 / kvscope p50 = {:.2}×, best Dynamo p99 / \
             kvscope p99 = {:.2}× (above 1: kvscope faster)",
            best_p50 as f64 / kv.p50_ns.max(1) as f64,
            best_p99 as f64 / kv.p99_ns.max(1) as f64,
        )?;
        if let Some(kv_heap) = kv.heap_per_pair {
            if let Some(min) = dynamo
                .iter()
                .filter_map(|r| r.heap_per_pair.map(|h| (h, &r.contender)))
                .min_by(|a, b| a.0.total_cmp(&b.0))
            {
                writeln!(
                    out,
                    "- memory: kvscope {kv_heap:.0} B per cached (block, worker) vs the \
                     leanest Dynamo indexer (`{}`) {:.0} B: {:.2}× (target ≤ 1×)",
                    min.1,
                    min.0,
                    kv_heap / min.0
                )?;
            }
        }
    }
    Ok(out)
}

/// Cores, memory, CPU and load: the figures mean little without them.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let mem_kb: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    format!(
        "Machine: {cores} cores ({model}), {:.1} GiB memory; load average at start {}.",
        mem_kb as f64 / (1024.0 * 1024.0),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    )
}
