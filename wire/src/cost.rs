//! The cost model of one migration (ARCHITECTURE.md, "The measurements"): handshake latency +
//! bytes / measured NIXL bandwidth between the pair + dispatch overhead, against
//! recomputing the delta at the prefill rate. Pure: figures in, prediction out. The
//! actuator prices each directive with it and the what-if each migration it predicts,
//! so both charge a migration the same.

use crate::nixl::NixlAgentRow;
use crate::nixl::{MergedLatency, NixlPair};
use crate::record::WorkerSpec;
use crate::WorkerKey;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// One Dynamo worker and the NIXL agent it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerAgent {
    /// The worker (instance) id the router logs.
    pub worker_id: u64,
    /// Data-parallel rank; absent: every rank of the worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// The NIXL agent name the worker's NIXL agent registers (as the eBPF probes see it).
    pub nixl_agent: String,
}

impl WorkerAgent {
    pub fn matches(&self, w: &WorkerKey) -> bool {
        WorkerSpec {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
        }
        .matches(w)
    }
}

impl std::str::FromStr for WorkerAgent {
    type Err = String;

    /// `WORKER_ID[/DP]=AGENT`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (worker, agent) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?} is not WORKER_ID[/DP]=AGENT"))?;
        let agent = agent.trim();
        if agent.is_empty() {
            return Err(format!("{s:?} has no agent name"));
        }
        let w: WorkerSpec = worker
            .parse()
            .map_err(|e| format!("{s:?} is not WORKER_ID[/DP]=AGENT: {e}"))?;
        Ok(WorkerAgent {
            worker_id: w.worker_id,
            dp_rank: w.dp_rank,
            nixl_agent: agent.to_string(),
        })
    }
}

/// The cost model's parameters (part of the policy config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostParams {
    pub kv_bytes_per_token: u64,
    /// Configured prefill rate of one worker, tokens/s.
    pub prefill_tok_per_s: f64,
    pub dispatch_overhead_s: f64,
    /// Which quantile of the measured handshake latency a migration is charged.
    pub handshake_quantile: f64,
}

/// Where a NIXL figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FigureSource {
    /// Measured between the two workers' NIXL agents.
    Pair,
    /// Measured over every NIXL pair the agents report: the workers are not mapped to
    /// NIXL agents, or their pair has no such measurement.
    FleetWide,
    /// Not measured anywhere.
    Missing,
    /// Given by the operator instead of what was measured.
    Given,
}

/// The NIXL figures of the path one migration would take.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathFigures {
    pub bandwidth_bytes_per_s: Option<f64>,
    pub bandwidth_from: FigureSource,
    pub handshake_s: Option<f64>,
    pub handshake_from: FigureSource,
}

pub use crate::directive::Prediction;

/// Predict one migration; `None` when the path lacks a bandwidth or handshake figure.
pub fn predict(
    p: &CostParams,
    tokens: u64,
    path: &PathFigures,
    prefill_tok_per_s: f64,
) -> Option<Prediction> {
    let bw = path.bandwidth_bytes_per_s.filter(|b| *b > 0.0)?;
    let handshake_s = path.handshake_s?;
    if prefill_tok_per_s.is_nan() || prefill_tok_per_s <= 0.0 {
        return None;
    }
    let bytes = tokens.saturating_mul(p.kv_bytes_per_token);
    let transfer_s = bytes as f64 / bw;
    let migrate_s = handshake_s + transfer_s + p.dispatch_overhead_s;
    let recompute_s = tokens as f64 / prefill_tok_per_s;
    Some(Prediction {
        tokens,
        bytes,
        handshake_s,
        transfer_s,
        dispatch_overhead_s: p.dispatch_overhead_s,
        migrate_s,
        recompute_s,
        prefill_tok_per_s,
        net_benefit_s: recompute_s - migrate_s,
    })
}

/// KV cache bytes per token of a model, from its Hugging Face `config.json`: K and V ×
/// layers × KV heads × head size × the dtype's bytes, or, for a model with latent
/// attention (MLA: `kv_lora_rank`), layers × (latent + rotary head size) × bytes. A
/// multimodal model's figures are read from its `text_config`. An engine running an fp8
/// KV cache holds half of an fp16 model's: give the bytes instead.
pub fn kv_bytes_per_token(config: &serde_json::Value) -> Result<u64, String> {
    let c = match config.get("text_config") {
        Some(t) if config.get("num_hidden_layers").is_none() => t,
        _ => config,
    };
    let num = |k: &str| {
        c.get(k)
            .and_then(serde_json::Value::as_u64)
            .filter(|&n| n > 0)
    };
    let layers = num("num_hidden_layers").ok_or("no num_hidden_layers")?;
    let dtype = c
        .get("torch_dtype")
        .or_else(|| c.get("dtype"))
        .or_else(|| config.get("torch_dtype"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("bfloat16");
    let bytes = match dtype {
        "float32" => 4,
        "float16" | "bfloat16" => 2,
        d if d.starts_with("float8") => 1,
        d => return Err(format!("dtype {d:?} has no known size")),
    };
    if let Some(latent) = num("kv_lora_rank") {
        let rope = num("qk_rope_head_dim").unwrap_or(0);
        return Ok(layers * (latent + rope) * bytes);
    }
    let heads = num("num_attention_heads").ok_or("no num_attention_heads")?;
    let kv_heads = num("num_key_value_heads").unwrap_or(heads);
    let head_dim = match num("head_dim") {
        Some(d) => d,
        None => num("hidden_size").ok_or("no head_dim or hidden_size")? / heads,
    };
    Ok(2 * layers * kv_heads * head_dim * bytes)
}

/// NIXL handshake counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeCounts {
    pub ok: u64,
    pub failed: u64,
}

impl HandshakeCounts {
    pub fn total(&self) -> u64 {
        self.ok + self.failed
    }
    pub fn success_ratio(&self) -> Option<f64> {
        (self.total() > 0).then(|| self.ok as f64 / self.total() as f64)
    }
    /// `self − earlier`; a counter that went down (an agent restarted) counts from zero.
    pub fn since(&self, earlier: &HandshakeCounts) -> HandshakeCounts {
        if self.ok < earlier.ok || self.failed < earlier.failed {
            *self
        } else {
            HandshakeCounts {
                ok: self.ok - earlier.ok,
                failed: self.failed - earlier.failed,
            }
        }
    }
}

/// The worker → NIXL agent mapping: the configured `[[worker_agents]]` first, then, for
/// the workers it does not name, what the node agents told from the processes. An agent
/// name told for two different workers (two nodes disagreeing) is left out.
pub fn mapping(configured: &[WorkerAgent], told: &[NixlAgentRow]) -> Vec<WorkerAgent> {
    let mut out = configured.to_vec();
    let mut by_agent: BTreeMap<&str, BTreeSet<(u64, Option<u32>)>> = BTreeMap::new();
    for r in told {
        if let Some(w) = r.owner.worker_id {
            by_agent
                .entry(r.owner.agent.as_str())
                .or_default()
                .insert((w, r.owner.dp_rank));
        }
    }
    for (agent, workers) in by_agent {
        let [(worker_id, dp_rank)] = workers.into_iter().collect::<Vec<_>>()[..] else {
            continue;
        };
        let configured_worker = configured.iter().any(|c| c.worker_id == worker_id);
        if !configured_worker && !out.iter().any(|m| m.nixl_agent == agent) {
            out.push(WorkerAgent {
                worker_id,
                dp_rank,
                nixl_agent: agent.to_string(),
            });
        }
    }
    out
}

/// What a migration is charged of the measured handshake latencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HandshakeCharge {
    /// A quantile of every handshake's latency, failed ones included: the actuator's, to
    /// price a migration it may still refuse conservatively.
    Quantile(f64),
    /// The mean of the successful handshakes: the what-if's, to predict what the
    /// migrations that go through cost in all (a failed `loadRemoteMD` returns early and
    /// would make a handshake look cheaper than it is).
    Mean,
}

impl HandshakeCharge {
    fn latency(self, p: &NixlPair) -> &MergedLatency {
        match self {
            HandshakeCharge::Quantile(_) => &p.handshake_latency,
            HandshakeCharge::Mean => &p.handshake_ok_latency,
        }
    }

    fn of(self, l: &MergedLatency) -> Option<f64> {
        let ns = match self {
            HandshakeCharge::Quantile(q) => l.quantile_ns(q)?,
            HandshakeCharge::Mean => l.sum_ns.checked_div(l.count)?,
        };
        Some(ns as f64 / 1e9)
    }
}

/// The NIXL figures of the fleet, looked up by Dynamo worker through the mapping.
#[derive(Debug)]
pub struct NixlFigures<'a> {
    pairs: &'a [NixlPair],
    mapping: &'a [WorkerAgent],
    charge: HandshakeCharge,
    fleet_bandwidth: Option<f64>,
    fleet_handshake_s: Option<f64>,
}

impl<'a> NixlFigures<'a> {
    /// Handshakes charged at `quantile` of their measured latency.
    pub fn new(pairs: &'a [NixlPair], mapping: &'a [WorkerAgent], quantile: f64) -> Self {
        Self::charging(pairs, mapping, HandshakeCharge::Quantile(quantile))
    }

    pub fn charging(
        pairs: &'a [NixlPair],
        mapping: &'a [WorkerAgent],
        charge: HandshakeCharge,
    ) -> Self {
        let (bytes, ns) = pairs.iter().fold((0u64, 0u64), |(b, n), p| {
            (b + p.bytes_ok, n + p.latency.sum_ns)
        });
        let mut hs = MergedLatency::default();
        for p in pairs {
            hs.merge(charge.latency(p));
        }
        Self {
            pairs,
            mapping,
            charge,
            fleet_bandwidth: (bytes > 0 && ns > 0).then(|| bytes as f64 / (ns as f64 / 1e9)),
            fleet_handshake_s: charge.of(&hs),
        }
    }

    pub fn mapped(&self) -> bool {
        !self.mapping.is_empty()
    }

    /// The NIXL agent a worker runs, from the mapping.
    pub fn agent_of(&self, w: &WorkerKey) -> Option<&'a str> {
        self.mapping
            .iter()
            .find(|m| m.matches(w))
            .map(|m| m.nixl_agent.as_str())
    }

    /// The pair a migration source → target uses: the target pulls (local = target's
    /// agent, remote = source's), else the source pushes.
    pub fn pair(&self, source: &WorkerKey, target: &WorkerKey) -> Option<&'a NixlPair> {
        let (s, t) = (self.agent_of(source)?, self.agent_of(target)?);
        let find = |l: &str, r: &str| {
            self.pairs
                .iter()
                .find(|p| p.local_agent == l && p.remote_agent == r)
        };
        find(t, s).or_else(|| find(s, t))
    }

    /// The figures of the path source → target, pair first, fleet-wide second.
    pub fn path(&self, source: &WorkerKey, target: &WorkerKey) -> PathFigures {
        let pair = self.pair(source, target);
        let from = |pair_value: Option<f64>, fleet: Option<f64>| match (pair_value, fleet) {
            (Some(v), _) => (Some(v), FigureSource::Pair),
            (None, Some(v)) => (Some(v), FigureSource::FleetWide),
            (None, None) => (None, FigureSource::Missing),
        };
        let (bandwidth_bytes_per_s, bandwidth_from) = from(
            pair.and_then(|p| p.bandwidth_bytes_per_second),
            self.fleet_bandwidth,
        );
        let (handshake_s, handshake_from) = from(
            pair.and_then(|p| self.charge.of(self.charge.latency(p))),
            self.fleet_handshake_s,
        );
        PathFigures {
            bandwidth_bytes_per_s,
            bandwidth_from,
            handshake_s,
            handshake_from,
        }
    }

    /// Handshakes over the pairs that matter: between mapped agents when there is a
    /// mapping, else every pair. A mapped agent's handshakes whose peer the probes could
    /// not name (a `loadRemoteMD` of metadata that did not parse: empty remote) count
    /// too — that is how a broken producer handshake looks from the loading side.
    pub fn handshakes(&self) -> HandshakeCounts {
        let agents: Vec<&str> = self.mapping.iter().map(|m| m.nixl_agent.as_str()).collect();
        self.pairs
            .iter()
            .filter(|p| {
                agents.is_empty()
                    || (agents.contains(&p.local_agent.as_str())
                        && (p.remote_agent.is_empty() || agents.contains(&p.remote_agent.as_str())))
            })
            .fold(HandshakeCounts::default(), |c, p| HandshakeCounts {
                ok: c.ok + p.handshakes_ok,
                failed: c.failed + p.handshakes_failed,
            })
    }

    pub fn fleet_bandwidth(&self) -> Option<f64> {
        self.fleet_bandwidth
    }
    pub fn fleet_handshake_s(&self) -> Option<f64> {
        self.fleet_handshake_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(l: &str, r: &str, bw: f64, hs_ns: u64) -> NixlPair {
        NixlPair {
            local_agent: l.into(),
            remote_agent: r.into(),
            bytes_ok: (bw * 0.5) as u64,
            latency: MergedLatency::exact(&[500_000_000]),
            bandwidth_bytes_per_second: Some(bw),
            handshakes_ok: 4,
            handshakes_failed: 1,
            // The failed one returned early.
            handshake_latency: MergedLatency::exact(&[hs_ns, hs_ns, hs_ns, hs_ns, hs_ns / 10]),
            handshake_ok_latency: MergedLatency::exact(&[hs_ns; 4]),
            ..NixlPair::default()
        }
    }

    fn w(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    const P: CostParams = CostParams {
        kv_bytes_per_token: 1000,
        prefill_tok_per_s: 10_000.0,
        dispatch_overhead_s: 0.01,
        handshake_quantile: 0.9,
    };

    #[test]
    fn the_prediction_adds_handshake_transfer_and_overhead_against_recompute() {
        let path = PathFigures {
            bandwidth_bytes_per_s: Some(1e9),
            bandwidth_from: FigureSource::Pair,
            handshake_s: Some(0.05),
            handshake_from: FigureSource::Pair,
        };
        // 20k tokens: 20 MB at 1 GB/s = 20 ms; + 50 ms + 10 ms = 80 ms vs 2 s recompute.
        let p = predict(&P, 20_000, &path, 10_000.0).unwrap();
        assert_eq!(p.bytes, 20_000_000);
        assert!((p.migrate_s - 0.08).abs() < 1e-9, "{p:?}");
        assert!((p.net_benefit_s - 1.92).abs() < 1e-9, "{p:?}");
        // 500 tokens: 50 ms recompute < 60.5 ms migration.
        assert!(predict(&P, 500, &path, 10_000.0).unwrap().net_benefit_s < 0.0);
        let no_bw = PathFigures {
            bandwidth_bytes_per_s: None,
            ..path
        };
        assert!(predict(&P, 20_000, &no_bw, 10_000.0).is_none());
    }

    #[test]
    fn pair_figures_come_first_then_fleet_wide() {
        let pairs = [
            pair("a", "b", 4e9, 2_000_000),
            pair("c", "d", 1e9, 40_000_000),
            // Failed loads of unparsable metadata: the probes know the loader only.
            NixlPair {
                local_agent: "a".into(),
                handshakes_failed: 3,
                ..NixlPair::default()
            },
            NixlPair {
                local_agent: "c".into(),
                handshakes_failed: 7,
                ..NixlPair::default()
            },
        ];
        let mapping: Vec<WorkerAgent> = vec!["1=b".parse().unwrap(), "2=a".parse().unwrap()];
        let f = NixlFigures::new(&pairs, &mapping, 0.9);
        // Source 1 (agent b) → target 2 (agent a): the target pulls, pair a → b.
        let p = f.path(&w(1), &w(2));
        assert_eq!(p.bandwidth_from, FigureSource::Pair);
        assert_eq!(p.bandwidth_bytes_per_s, Some(4e9));
        assert_eq!(
            p.handshake_s,
            Some(0.002),
            "p90: bucket bound 2.5 ms capped at the max"
        );
        // The reverse direction finds the same pair (source pushes).
        assert_eq!(f.path(&w(2), &w(1)).bandwidth_from, FigureSource::Pair);
        // Unmapped worker 3: fleet-wide.
        let p = f.path(&w(1), &w(3));
        assert_eq!(p.bandwidth_from, FigureSource::FleetWide);
        let bw = p.bandwidth_bytes_per_s.unwrap();
        assert!((bw - 2.5e9).abs() < 1.0, "{bw}");
        assert_eq!(
            f.handshakes(),
            HandshakeCounts { ok: 4, failed: 4 },
            "the pair between mapped agents, and a mapped agent's loads of unnamed peers"
        );
        // The what-if's charge: the mean of the successful handshakes only.
        let mean = NixlFigures::charging(&pairs, &mapping, HandshakeCharge::Mean);
        assert_eq!(mean.path(&w(1), &w(2)).handshake_s, Some(0.002));
        let hs = mean.fleet_handshake_s().unwrap();
        assert!((hs - 0.021).abs() < 1e-12, "{hs}");
        let none = NixlFigures::new(&[], &[], 0.9).path(&w(1), &w(2));
        assert_eq!(none.handshake_from, FigureSource::Missing);
    }

    #[test]
    fn kv_bytes_per_token_from_model_configs() {
        // Llama 3.1 8B: 32 layers × 8 KV heads × 128 × K, V × 2 bytes.
        let llama = serde_json::json!({
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "torch_dtype": "bfloat16"
        });
        assert_eq!(kv_bytes_per_token(&llama), Ok(131_072));
        // DeepSeek V3: 61 layers × (512 latent + 64 rotary) × 2 bytes.
        let mla = serde_json::json!({
            "num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"
        });
        assert_eq!(kv_bytes_per_token(&mla), Ok(61 * 576 * 2));
        let multimodal = serde_json::json!({"torch_dtype": "float16", "text_config": {
            "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64
        }});
        assert_eq!(kv_bytes_per_token(&multimodal), Ok(2 * 2 * 4 * 64 * 2));
        assert!(kv_bytes_per_token(&serde_json::json!({})).is_err());
        let odd = serde_json::json!({"num_hidden_layers": 2, "num_attention_heads": 4,
            "head_dim": 64, "torch_dtype": "int3"});
        assert!(kv_bytes_per_token(&odd).unwrap_err().contains("int3"));
    }

    #[test]
    fn handshake_deltas_survive_counter_resets() {
        let now = HandshakeCounts { ok: 10, failed: 3 };
        assert_eq!(
            now.since(&HandshakeCounts { ok: 7, failed: 1 }),
            HandshakeCounts { ok: 3, failed: 2 }
        );
        assert_eq!(now.since(&HandshakeCounts { ok: 20, failed: 0 }), now);
        assert_eq!(HandshakeCounts::default().success_ratio(), None);
    }
}
