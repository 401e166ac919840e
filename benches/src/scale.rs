//! `scale`: fill the mirror to fleet scale (every worker's cache full), then measure its
//! memory and the latency of routing queries against it.

use crate::compare::machine;
use crate::contenders::{Contender, DynamoRadixTree, DynamoThreadPool, Kvscope};
use crate::measure::{self, quantile, replay};
use crate::synthetic::{FleetGen, FleetSpec};
use crate::trace::Trace;
use std::time::Instant;

#[derive(clap::Args)]
pub struct ScaleArgs {
    /// Workers in the fleet.
    #[arg(long = "workers", default_value_t = 1000)]
    fleet_size: u32,
    /// Each worker's KV cache, in blocks; the fill runs until every worker is this full
    /// (within `--full`).
    #[arg(long, default_value_t = 50_000)]
    blocks_per_worker: u32,
    /// A worker counts as full from this share of its capacity.
    #[arg(long, default_value_t = 0.98)]
    full: f64,
    /// Routed requests measured once the fleet is full.
    #[arg(long, default_value_t = 20_000)]
    queries: u64,
    /// Also count live heap bytes (a relaxed atomic per allocation).
    #[arg(long)]
    count_allocations: bool,
    /// `kvscope`, or for comparison `dynamo-radix-tree` / `dynamo-crtc-1`.
    #[arg(long, default_value = "kvscope")]
    contender: String,
    /// The rest of the workload's shape (workers and capacity are set above; worker
    /// restarts are off so that the fill ends).
    #[command(flatten)]
    fleet: FleetSpec,
}

pub fn scale(args: ScaleArgs) -> anyhow::Result<()> {
    if args.count_allocations {
        measure::start_counting();
    }
    let spec = FleetSpec {
        workers: args.fleet_size,
        capacity_blocks: args.blocks_per_worker,
        clear_every: 0,
        ..args.fleet.clone()
    };
    let full = (f64::from(spec.capacity_blocks) * args.full) as u64;
    println!("{}", machine());
    eprintln!(
        "kvscope-bench scale: generating the fill ({} workers × {} blocks) …",
        spec.workers, spec.capacity_blocks
    );
    let t = Instant::now();
    let mut fill = Trace::new("fill");
    let mut gen = FleetGen::new(spec.clone(), &mut fill);
    let mut requests = 0u64;
    while !requests.is_multiple_of(1000) || gen.min_worker_blocks() < full {
        gen.request(&mut fill, false);
        requests += 1;
    }
    let pairs_full = gen.cached_pairs();
    let mut measured = Trace::continuing("measured", &fill);
    for _ in 0..args.queries {
        gen.request(&mut measured, true);
    }
    let pairs_end = gen.cached_pairs();
    drop(gen);
    let (fill, measured) = (fill.finish(), measured.finish());
    eprintln!(
        "kvscope-bench scale: {requests} requests, {} stored blocks, {} pairs cached, in {:.1} s; \
         stream {:.0} MB",
        fill.stats.stored_blocks,
        pairs_full,
        t.elapsed().as_secs_f64(),
        (fill.heap_bytes() + measured.heap_bytes()) as f64 / 1e6
    );
    let counting = args.count_allocations;
    let report = match args.contender.as_str() {
        "kvscope" => run(Kvscope::new(), &fill, &measured, counting),
        "dynamo-radix-tree" => run(DynamoRadixTree::new(), &fill, &measured, counting),
        "dynamo-crtc-1" => run(DynamoThreadPool::crtc(1), &fill, &measured, counting),
        other => anyhow::bail!("unknown contender for scale {other:?}"),
    };
    let gib = |b: i64| b as f64 / (1u64 << 30) as f64;
    println!(
        "\n## Scale: `{}`, {} workers × {} blocks ({} requests to fill)\n",
        args.contender, spec.workers, spec.capacity_blocks, requests
    );
    println!("| figure | value | target |");
    println!("|---|---:|---:|");
    println!(
        "| cached (block, worker) pairs when full | {pairs_full} ({:.1}k per worker) | 1,000 × 50k |",
        pairs_full as f64 / f64::from(spec.workers) / 1e3
    );
    println!(
        "| mirror memory when full (RSS growth) | {:.2} GiB ({:.0} B/pair) | ≤ 4 GiB |",
        gib(report.rss_delta),
        report.rss_delta as f64 / pairs_full as f64
    );
    if let Some(h) = report.heap_delta {
        println!(
            "| mirror live heap when full | {:.2} GiB ({:.0} B/pair) | |",
            gib(h),
            h as f64 / pairs_full as f64
        );
    }
    println!(
        "| process RSS when full (mirror + the stream it was fed, {:.2} GiB) | {:.2} GiB | |",
        gib((fill.heap_bytes() + measured.heap_bytes()) as i64),
        gib(report.rss_total as i64)
    );
    println!(
        "| fill: block ops/s | {:.2} M ({:.0} ns per stored or removed block) | |",
        report.fill_ops as f64 / report.fill_secs / 1e6,
        report.fill_secs * 1e9 / report.fill_ops as f64
    );
    println!(
        "| {} routed requests on the full fleet: query p50 / p90 / p99 / max | {:.1} / {:.1} / {:.1} / {:.1} µs | p99 ≤ 100 µs |",
        args.queries,
        report.p50 as f64 / 1e3,
        report.p90 as f64 / 1e3,
        report.p99 as f64 / 1e3,
        report.max as f64 / 1e3
    );
    println!(
        "| their query length (blocks) mean / max | {:.0} / {} | |",
        measured.stats.query_blocks as f64 / measured.stats.queries.max(1) as f64,
        report.longest_query
    );
    println!(
        "| workers with a non-zero overlap per query, mean | {:.0} | |",
        report.mean_holders
    );
    println!("| pairs cached at the end | {pairs_end} | |");
    Ok(())
}

struct ScaleReport {
    rss_delta: i64,
    heap_delta: Option<i64>,
    rss_total: u64,
    fill_ops: u64,
    fill_secs: f64,
    p50: u64,
    p90: u64,
    p99: u64,
    max: u64,
    longest_query: u32,
    mean_holders: f64,
}

fn run<C: Contender>(mut c: C, fill: &Trace, measured: &Trace, counting: bool) -> ScaleReport {
    let (h0, r0) = (measure::live_heap(), measure::rss_bytes());
    eprintln!("kvscope-bench scale: filling …");
    let f = replay(&mut c, fill);
    let heap_delta = counting.then(|| (measure::live_heap() - h0) as i64);
    let rss_total = measure::rss_bytes();
    let rss_delta = rss_total as i64 - r0 as i64;
    eprintln!(
        "kvscope-bench scale: filled in {:.1} s; querying …",
        f.apply.as_secs_f64()
    );
    let q = replay(&mut c, measured);
    let longest_query = measured
        .ops
        .iter()
        .filter_map(|op| match op {
            crate::trace::Op::Query { locals } => Some(locals.len),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    ScaleReport {
        rss_delta,
        heap_delta,
        rss_total,
        fill_ops: fill.stats.stored_blocks + fill.stats.removed_blocks,
        fill_secs: f.apply.as_secs_f64(),
        p50: quantile(&q.latencies_ns, 0.5),
        p90: quantile(&q.latencies_ns, 0.9),
        p99: quantile(&q.latencies_ns, 0.99),
        max: q.latencies_ns.iter().copied().max().unwrap_or(0),
        longest_query,
        mean_holders: q.holders as f64 / q.latencies_ns.len().max(1) as f64,
    }
}
