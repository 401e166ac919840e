//! The what-if's inputs, as `kvscope whatif` takes them (flags) and `/api/whatif` takes
//! them (a query string), and its answer: every question asked of one set of requests.

use super::disagg::{DisaggError, DisaggWhatIf, TtftSample};
use super::migration::{MigrationQuestion, MigrationWhatIf, Pricing, DEFAULT_GATES};
use super::router::{RouterSettings, RouterWhatIf, RouterWhatIfError};
use super::{CapacityWhatIf, WhatIf, WhatIfError};
use serde::{Deserialize, Deserializer, Serialize};
use std::path::PathBuf;

/// The actuator's default prefill rate, tokens/s per worker.
pub(crate) const DEFAULT_PREFILL_TOK_PER_S: f64 = 10_000.0;
/// The actuator's default KV bytes per token: an 8B model in fp16 (32 layers × 8 KV
/// heads × 128 dims × K and V × 2 bytes).
pub(crate) const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 131_072;

/// What to predict, and what to price it with (see `kvscope whatif --help`).
#[derive(clap::Args, Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WhatIfInputs {
    /// Each worker's KV cache in the recorded run, in blocks (the engine's
    /// --num-gpu-blocks). Default: what Dynamo's discovery says of each worker
    /// (`total_kv_blocks`), from the recording.
    #[arg(long)]
    pub gpu_blocks: Option<u64>,
    /// The shares of each worker's cache to set aside, comma-separated, each in [0, 1)
    /// [default: 0,0.05,0.1,0.15,0.2].
    #[arg(long, value_delimiter = ',')]
    #[serde(deserialize_with = "comma_list")]
    pub reserve: Vec<f64>,
    /// KV cache bytes per token of the served model. Default: from --model-config, else
    /// 131072 (an 8B model in fp16), said so in the answer.
    #[arg(long)]
    pub kv_bytes_per_token: Option<u64>,
    /// The model's Hugging Face `config.json`: KV bytes per token from its layers, KV
    /// heads, head size and dtype (or its latent KV size for MLA models).
    #[arg(long, conflicts_with = "kv_bytes_per_token")]
    #[serde(skip)]
    pub model_config: Option<PathBuf>,
    /// Prefill rate of one worker, tokens/s [default: 10000, the actuator's].
    #[arg(long)]
    pub prefill_tok_per_s: Option<f64>,
    /// Fixed cost of dispatching one migration, milliseconds [default: 5, the actuator's].
    #[arg(long)]
    pub dispatch_overhead_ms: Option<f64>,
    /// NIXL bandwidth to charge every migration, GB/s. Default: what the eBPF probes
    /// measured per pair in the recording (fleet-wide where a pair was not measured).
    #[arg(long)]
    pub nixl_bandwidth_gbps: Option<f64>,
    /// Handshake latency to charge every migration, milliseconds. Default: the mean of
    /// the successful handshakes the probes measured per pair in the recording.
    #[arg(long)]
    pub handshake_ms: Option<f64>,
    /// Token gates to try (the actuator's `min_tokens`), comma-separated
    /// [default: 16,256,1024,4096,16384,65536].
    #[arg(long, value_delimiter = ',')]
    #[serde(deserialize_with = "comma_list")]
    pub gate: Vec<u64>,
    /// The share NixlConnector's buffers would take: the reserve the recommended
    /// thresholds are for (added to the reserves swept) [default: 0.1].
    #[arg(long)]
    pub connector_reserve: Option<f64>,
    /// Conditional disaggregation: measured time-to-first-token samples of both paths
    /// (repeatable): JSON lines with `prompt_tokens`, `ttft_ms`, `remote` (or
    /// `prefill_worker_id`) and optionally `cached_tokens`, or a `kvscope-lab workload
    /// --stream` summary. Each path is fitted as fixed + per-token × uncached tokens; the
    /// answer is the break-even uncached size and the frontend's setting. Without
    /// --replay, the samples' own requests are judged. Without samples, a recording's
    /// own request ends (Dynamo's request trace: each request's first token and prefill
    /// worker) are the samples, where they hold both paths.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub ttft_samples: Vec<PathBuf>,
    /// Conditional-disaggregation thresholds (uncached tokens) to tabulate,
    /// comma-separated [default: 256,512,1024,2048,4096,8192,16384].
    #[arg(long, value_delimiter = ',')]
    #[serde(deserialize_with = "comma_list")]
    pub disagg_threshold: Vec<u64>,
    /// Router knobs: a change of the router's settings to predict (repeatable), as
    /// `key=value` pairs of Dynamo's frontend flags without `--router-`, comma-separated:
    /// `session-affinity-ttl-secs=N|off`, `track-output-blocks=true|false`,
    /// `kv-overlap-score-credit=X`, `prefill-load-scale=X`, `kv-overlap-score-weight=X`
    /// (deprecated: the load scale, and credit 0 at 0), `temperature=X`. The recorded
    /// requests are routed again by Dynamo's own load tracker and selector, timed by
    /// Dynamo's request trace (DYN_REQUEST_TRACE=1) [default:
    /// session-affinity-ttl-secs=300, track-output-blocks=true,
    /// kv-overlap-score-credit=0.5, kv-overlap-score-credit=2]. In a query string,
    /// changes are separated by `;`.
    #[arg(long = "router", value_name = "CHANGE")]
    #[serde(deserialize_with = "semicolon_list")]
    pub router: Vec<String>,
    /// The recorded run's router settings, as a change of Dynamo 1.6.1's defaults in
    /// the same form (e.g. `temperature=0.2`) [default: Dynamo's defaults].
    #[arg(long, value_name = "CHANGE")]
    pub router_recorded: Option<String>,
    /// Runs of the router model per setting, each with its own seed for the selector's
    /// tie-breaks and sampling, 1 to 16 [default: 3].
    #[arg(long)]
    pub router_runs: Option<u32>,
}

/// The changes the router knobs are asked about when none are given.
pub(crate) const DEFAULT_ROUTER_CHANGES: [&str; 4] = [
    "session-affinity-ttl-secs=300",
    "track-output-blocks=true",
    "kv-overlap-score-credit=0.5",
    "kv-overlap-score-credit=2",
];

/// `a=1,b=2;c=3` in a query string: changes separated by `;`.
fn semicolon_list<'de, D>(d: D) -> Result<Vec<String>, D::Error>
where
    D: Deserializer<'de>,
{
    let s = String::deserialize(d)?;
    Ok(s.split(';')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect())
}

/// `0,0.15` in a query string.
fn comma_list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: std::str::FromStr,
{
    let s = String::deserialize(d)?;
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.trim()
                .parse::<T>()
                .map_err(|_| serde::de::Error::custom(format!("{p:?} in {s:?} is not a number")))
        })
        .collect()
}

/// Every question the what-if answers, on one set of requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WhatIfAnswer {
    pub capacity: CapacityWhatIf,
    pub migration: MigrationWhatIf,
    /// With TTFT samples: conditional disaggregation's break-even.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disagg: Option<DisaggWhatIf>,
    /// The router knobs, where the recording times the requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterWhatIf>,
    /// Why the router knobs were not predicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_unavailable: Option<String>,
}

/// Why the inputs cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("reading the model config {0}: {1}")]
    ModelConfig(PathBuf, String),
    #[error(transparent)]
    WhatIf(#[from] WhatIfError),
    #[error(transparent)]
    Disagg(#[from] DisaggError),
    #[error(transparent)]
    Router(#[from] RouterWhatIfError),
}

impl WhatIfInputs {
    /// The answer a report carries: what the requests lack (no cache size known, no
    /// request judged) is `Ok(Err(why))`, for the report to say; a bad input is an error.
    pub fn answer_for_report(
        &self,
        w: &WhatIf,
    ) -> Result<Result<WhatIfAnswer, String>, InputError> {
        match self.answer(w) {
            Ok(a) => Ok(Ok(a)),
            Err(InputError::WhatIf(
                e @ (WhatIfError::UnknownCapacity(_) | WhatIfError::NoRequests),
            )) => Ok(Err(e.to_string())),
            Err(e) => Err(e),
        }
    }

    fn pricing(&self) -> Result<Pricing, InputError> {
        let (kv_bytes_per_token, kv_bytes_from) =
            match (&self.kv_bytes_per_token, &self.model_config) {
                (Some(b), _) => (*b, "given".to_string()),
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(path)
                        .map_err(|e| InputError::ModelConfig(path.clone(), e.to_string()))?;
                    let cfg: serde_json::Value = serde_json::from_str(&text)
                        .map_err(|e| InputError::ModelConfig(path.clone(), e.to_string()))?;
                    let b = kvscope_wire::cost::kv_bytes_per_token(&cfg)
                        .map_err(|e| InputError::ModelConfig(path.clone(), e))?;
                    (b, format!("from {}", path.display()))
                }
                (None, None) => (
                    DEFAULT_KV_BYTES_PER_TOKEN,
                    "default, an 8B model in fp16: give --kv-bytes-per-token or --model-config"
                        .to_string(),
                ),
            };
        Ok(Pricing {
            kv_bytes_per_token,
            kv_bytes_from,
            prefill_tok_per_s: self.prefill_tok_per_s.unwrap_or(DEFAULT_PREFILL_TOK_PER_S),
            prefill_from: if self.prefill_tok_per_s.is_some() {
                "given"
            } else {
                "default, the actuator's: give --prefill-tok-per-s"
            }
            .to_string(),
            dispatch_overhead_s: self.dispatch_overhead_ms.unwrap_or(5.0) / 1e3,
            bandwidth_bytes_per_s: self.nixl_bandwidth_gbps.map(|g| g * 1e9),
            handshake_s: self.handshake_ms.map(|h| h / 1e3),
        })
    }

    /// Every question asked of `w`.
    pub fn answer(&self, w: &WhatIf) -> Result<WhatIfAnswer, InputError> {
        let mut reserves = if self.reserve.is_empty() {
            vec![0.0, 0.05, 0.1, 0.15, 0.2]
        } else {
            self.reserve.clone()
        };
        let capacity = w.capacity(self.gpu_blocks, &reserves)?;
        let connector_reserve = self.connector_reserve.unwrap_or(0.1);
        if !reserves.contains(&connector_reserve) {
            reserves.push(connector_reserve);
        }
        let migration = w.migration(&MigrationQuestion {
            pricing: self.pricing()?,
            gates: if self.gate.is_empty() {
                DEFAULT_GATES.to_vec()
            } else {
                self.gate.clone()
            },
            reserves,
            connector_reserve,
            gpu_blocks: self.gpu_blocks,
        })?;
        let (router, router_unavailable) = match self.router_knobs(w) {
            Ok(r) => (Some(r), None),
            Err(e @ (RouterWhatIfError::NoTiming | RouterWhatIfError::Uncalibrated(_))) => {
                (None, Some(e.to_string()))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(WhatIfAnswer {
            capacity,
            migration,
            disagg: self.disagg(Some(w))?,
            router,
            router_unavailable,
        })
    }

    /// The router knobs asked about (or the default ones), on `w`'s requests.
    pub fn router_knobs(&self, w: &WhatIf) -> Result<RouterWhatIf, RouterWhatIfError> {
        let recorded = RouterSettings::default()
            .changed(self.router_recorded.as_deref().unwrap_or_default())?;
        let changes: Vec<String> = if self.router.is_empty() {
            DEFAULT_ROUTER_CHANGES
                .iter()
                .map(|c| c.to_string())
                .collect()
        } else {
            self.router.clone()
        };
        w.router_knobs(
            recorded,
            &changes,
            self.router_runs.unwrap_or(3),
            self.gpu_blocks,
        )
    }

    /// Conditional disaggregation, where TTFT samples are given: judged on `w`'s
    /// requests (uncached = prompt − the chosen worker's cached prefix), else on the
    /// samples' own.
    ///
    /// Without samples given, the recording's own request ends are the samples (Dynamo's
    /// request trace times each request's first token and names its prefill worker), and
    /// the question is answered where they hold both paths.
    pub fn disagg(&self, w: Option<&WhatIf>) -> Result<Option<DisaggWhatIf>, InputError> {
        let given = !self.ttft_samples.is_empty();
        let (samples, left_out, from) = if given {
            let mut samples: Vec<TtftSample> = Vec::new();
            let mut left_out = 0;
            for path in &self.ttft_samples {
                let (s, l) = super::disagg::read_samples(path)?;
                samples.extend(s);
                left_out += l;
            }
            let from = self
                .ttft_samples
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ");
            (samples, left_out, from)
        } else {
            let Some(w) = w else {
                return Ok(None);
            };
            let (samples, left_out) = w.ttft_samples();
            let from = "the recording's request ends (Dynamo's request trace)".to_string();
            (samples, left_out, from)
        };
        let judged: Vec<(u64, u64)> = w
            .map(|w| {
                w.requests()
                    .iter()
                    .map(|r| {
                        let cached = super::cached_tokens(
                            r.isl_tokens,
                            r.recorded_overlap_blocks.into(),
                            r.block_size,
                        );
                        (r.isl_tokens - cached, r.isl_tokens)
                    })
                    .collect()
            })
            .unwrap_or_default();
        match super::disagg::answer(
            &samples,
            from,
            left_out,
            Some((&judged, "the recording's judged requests".to_string())),
            &self.disagg_threshold,
        ) {
            Ok(a) => Ok(Some(a)),
            // A recording whose requests all took one path cannot fit the other.
            Err(DisaggError::TooFew { .. }) if !given => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

impl WhatIfAnswer {
    /// Each question's answer in Markdown, a heading each.
    pub fn markdown_parts(&self) -> Vec<String> {
        let mut parts = vec![self.capacity.to_markdown(), self.migration.to_markdown()];
        parts.extend(self.disagg.as_ref().map(|d| d.to_markdown()));
        parts.extend(self.router.as_ref().map(|r| r.to_markdown()));
        parts.extend(self.router_unavailable.as_ref().map(|why| {
            format!("# What if the router were set otherwise\n\nNot predicted: {why}.\n")
        }));
        parts
    }

    pub fn to_markdown(&self) -> String {
        self.markdown_parts().join("\n")
    }
}
