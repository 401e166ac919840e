//! The physical floor the mirror's events are measured against (issue 42: "one DRAM miss
//! per block"): what one cache miss to memory costs on this machine, alone and when
//! several are in flight at once. A buffer of cache lines larger than the caches is linked
//! into one random cycle (each line holds the index of the next); a chain of loads that
//! follows it misses on every line, and each load waits for the one before (the latency).
//! `--chains` walks that many places of the cycle in one loop, so their misses overlap (what
//! a batch of independent lookups, such as a store's blocks' buckets, can reach at best).
//! The pages are touched before timing, and the lines are random across the whole buffer,
//! so each miss pays its page walk too, as a lookup in a table of that size does.

use kvscope_lab::workload::SplitMix64;
use std::hint::black_box;
use std::time::Instant;

#[derive(clap::Args)]
pub struct FloorArgs {
    /// Buffer sizes, MiB (each a separate measurement). The synthetic fleet's mirror (its
    /// per-worker engine-hash tables and trie records) is ~66 MiB resident.
    #[arg(long, value_delimiter = ',', default_value = "16,256,1024")]
    mib: Vec<u64>,
    /// How many independent chains to walk side by side, each count a measurement
    /// (comma-separated; 1: every load waits for the one before).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    chains: Vec<usize>,
    /// Loads timed per measurement.
    #[arg(long, default_value_t = 20_000_000)]
    loads: u64,
    /// Rounds per measurement: the median and the spread are printed.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// Words per 64-byte cache line.
const LINE_WORDS: usize = 8;

/// The largest buffer asked for (line numbers fit in a `u32`).
const MAX_MIB: u64 = 64 << 10;

pub fn floor(args: FloorArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(args.loads > 0, "--loads must be at least 1");
    if let Some(c) = args.chains.iter().find(|c| **c == 0 || **c > 64) {
        anyhow::bail!("--chains {c}: from 1 to 64 chains");
    }
    if let Some(m) = args.mib.iter().find(|m| **m == 0 || **m > MAX_MIB) {
        anyhow::bail!("--mib {m}: from 1 to {MAX_MIB} MiB");
    }
    println!(
        "ns per load of a random cache line (median of {} rounds, min-max); a chain's loads \
         each wait for the one before, chains run side by side",
        args.rounds
    );
    println!("{:>8} {:>7} {:>22}", "MiB", "chains", "ns per load");
    for &mib in &args.mib {
        let lines = (mib as usize) << 20 >> 6;
        eprintln!("floor: linking {mib} MiB into one random cycle");
        let (cycle, order) = random_cycle(lines)?;
        for &chains in &args.chains {
            let mut ns: Vec<f64> = (0..args.rounds)
                .map(|_| walk(&cycle, &order, chains, args.loads))
                .collect();
            ns.sort_by(f64::total_cmp);
            println!(
                "{mib:>8} {chains:>7} {:>8.1} ({:.1}-{:.1})",
                ns[ns.len() / 2],
                ns[0],
                ns[ns.len() - 1]
            );
        }
    }
    Ok(())
}

/// `lines` cache lines, each holding (in its first word) the index of the next line of a
/// single cycle through all of them in random order (Sattolo's shuffle); and that order,
/// where the chains start from.
fn random_cycle(lines: usize) -> anyhow::Result<(Vec<u64>, Vec<u32>)> {
    let mut order: Vec<u32> = Vec::new();
    let mut cycle: Vec<u64> = Vec::new();
    order
        .try_reserve_exact(lines)
        .and_then(|()| cycle.try_reserve_exact(lines * LINE_WORDS))
        .map_err(|e| anyhow::anyhow!("{} MiB buffer: {e}", (lines << 6) >> 20))?;
    order.extend(0..lines as u32);
    let mut rng = SplitMix64::new(0x006b_7673_636f_7065);
    for i in (1..lines).rev() {
        let j = rng.below(i as u64) as usize;
        order.swap(i, j);
    }
    cycle.resize(lines * LINE_WORDS, 0);
    for w in order.windows(2) {
        cycle[w[0] as usize * LINE_WORDS] = u64::from(w[1]);
    }
    if let (Some(last), Some(first)) = (order.last(), order.first()) {
        cycle[*last as usize * LINE_WORDS] = u64::from(*first);
    }
    Ok((cycle, order))
}

/// Nanoseconds per load, `chains` walks of the cycle side by side, `loads` loads in all.
fn walk(cycle: &[u64], order: &[u32], chains: usize, loads: u64) -> f64 {
    // Starting points evenly spaced along the cycle, so the chains never meet.
    let mut at = [0u64; 64];
    let spacing = order.len() / chains;
    for (i, slot) in at.iter_mut().enumerate().take(chains) {
        *slot = u64::from(order[i * spacing]);
    }
    let steps = (loads / chains as u64).max(1);
    let start = Instant::now();
    for _ in 0..steps {
        for a in at.iter_mut().take(chains) {
            *a = cycle[*a as usize * LINE_WORDS];
        }
    }
    let elapsed = start.elapsed();
    black_box(&at);
    elapsed.as_nanos() as f64 / (steps * chains as u64) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cycle_visits_every_line_once() {
        let lines = 1000;
        let (cycle, order) = random_cycle(lines).unwrap();
        assert_eq!(order.len(), lines);
        let mut seen = vec![false; lines];
        let mut p = 0usize;
        for _ in 0..lines {
            assert!(!seen[p], "line {p} visited twice");
            seen[p] = true;
            p = cycle[p * LINE_WORDS] as usize;
        }
        assert_eq!(p, 0, "the walk is one cycle back to its start");
        assert!(seen.iter().all(|s| *s));
    }
}
