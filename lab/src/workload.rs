//! A bounded multi-turn chat workload against the Dynamo frontend.
//!
//! `families` conversation families each have a shared system prompt whose first 256+
//! tokens differ between families; `sessions` conversations are spread round-robin over
//! the families, or, for a long-tailed shape ([`PromptShape::LongTailed`]), by
//! popularity, with prompts and turns of long-tailed lengths. Each turn appends a new user message to the conversation so far (system
//! prompt, earlier user turns and the model's replies), so the prompt grows by appending,
//! as in real chat. Content is deterministic given `seed`; the mocker's replies are not,
//! unless `fixed_answers` is set (see [`answer_trace`]): then every reply is planned from
//! the seed too, and comes back as the same tokens in the session's next turn.
//!
//! With the lab's model fixture one word (`w0` … `w1999`) is one token, and the chat
//! template renders `<|role|> content ` per message, so prompt token counts are exact.
//!
//! Every request carries `x-request-id: <tag>-f<family>-s<session>-t<turn>`; the router
//! logs it as the span field `x_request_id="…"` on its `[ROUTING_INPUT]` line. The
//! router's own `request_id` (on `[ROUTING_INPUT]` and `Selected worker`) is the
//! response `id` without its `chatcmpl-` / `cmpl-` prefix; both are recorded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{Mutex, Semaphore};
use tracing::{debug, info, warn};

/// Which OpenAI endpoint to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `/v1/chat/completions` with `messages` (the model's chat template renders them).
    Chat,
    /// `/v1/completions` with the same conversation rendered as a plain prompt.
    Completions,
}

/// How the workload's prompts are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PromptShape {
    /// Small and uniform: every family's system prompt `system_words` long (or drawn
    /// uniformly up to `system_words_max`), sessions dealt round-robin over the
    /// families, every user turn `user_words` long.
    #[default]
    Uniform,
    /// Shaped like production traffic, long-tailed: system prompts drawn log-uniformly
    /// from `system_words` to `system_words_max`, the last `document_families`
    /// families' prompts a document of `document_words`; sessions choose their family
    /// by popularity (Zipf: the first family twice as popular as the second, …, each
    /// family at least one session, the last of 16 a quarter as popular as the first),
    /// so many sessions share the popular system prompts and a few each document;
    /// user turns drawn log-normally around `user_words` (a few far longer: pasted text),
    /// at most `user_words_max`.
    LongTailed,
}

/// Workload parameters. Every field has a default.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkloadConfig {
    /// Frontend base URL, e.g. `http://127.0.0.1:8000`.
    pub frontend: String,
    /// Model name; default: the first model `/v1/models` lists.
    pub model: Option<String>,
    /// Endpoint to use. Default chat.
    pub api: Api,
    /// Seed for all generated content. Default 1.
    pub seed: u64,
    /// Conversation families (distinct system prompts). Default 4.
    pub families: usize,
    /// Conversations in total. Default 24.
    pub sessions: usize,
    /// Maximum requests in flight. Default 12.
    pub concurrency: usize,
    /// Maximum request rate (requests/s over all sessions); none = unlimited. Default 20.
    pub rate: Option<f64>,
    /// Turns (requests) per conversation. Default 4.
    pub max_turns: usize,
    /// Stop sending new requests after this many seconds. Default 60.
    pub duration_secs: f64,
    /// `max_tokens` of each request. Default 48.
    pub max_tokens: u32,
    /// Words in each family's system prompt (≥ 256). Default 320.
    pub system_words: usize,
    /// Words per user turn. Default 40.
    pub user_words: usize,
    /// Per-request timeout in seconds. Default 60.
    pub request_timeout_secs: f64,
    /// Pause between a reply and the session's next turn, in milliseconds. Default 0.
    pub think_time_ms: u64,
    /// Prefix of the `x-request-id` header values. Default `kvs<seed>`.
    pub tag: Option<String>,
    /// Ask the mockers for planned replies ([`answer_trace`], which their
    /// `--response-replay-trace-path` must hold), so that each reply's tokens, and the
    /// blocks its decode generated, come back in the next turn; and check that each
    /// reply was the planned one. Default false (the mocker's random tokens).
    pub fixed_answers: bool,
    /// Stream each reply (`stream: true`) and record its time to first token
    /// ([`RequestRecord::ttft_ms`]). Default false.
    pub stream: bool,
    /// Draw each family's system prompt length from `system_words ..= system_words_max`
    /// words (seeded), instead of `system_words` for all: prompts of many sizes, as
    /// conditional disaggregation's thresholds need. Default none.
    pub system_words_max: Option<usize>,
    /// Name each conversation's session as Dynamo's frontend reads it for session
    /// affinity (`x-dynamo-session-id: <tag>-s<session>`), so a frontend started with
    /// `--router-session-affinity-ttl-secs` keeps a conversation on one worker.
    /// Default false.
    pub session_ids: bool,
    /// How prompts are shaped (see [`PromptShape`]). Default uniform.
    pub shape: PromptShape,
    /// Families whose system prompt is a long document (`document_words`), the last
    /// ones. Default 0.
    pub document_families: usize,
    /// Words in a document family's prompt. Default 135,000 (past a 128k context).
    pub document_words: usize,
    /// The longest user turn a long-tailed shape draws, in words. Default 8,192.
    pub user_words_max: usize,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            frontend: "http://127.0.0.1:8000".into(),
            model: None,
            api: Api::Chat,
            seed: 1,
            families: 4,
            sessions: 24,
            concurrency: 12,
            rate: Some(20.0),
            max_turns: 4,
            duration_secs: 60.0,
            max_tokens: 48,
            system_words: 320,
            user_words: 40,
            request_timeout_secs: 60.0,
            think_time_ms: 0,
            tag: None,
            fixed_answers: false,
            stream: false,
            system_words_max: None,
            session_ids: false,
            shape: PromptShape::Uniform,
            document_families: 0,
            document_words: 135_000,
            user_words_max: 8192,
        }
    }
}

/// One request the workload sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RequestRecord {
    pub family: usize,
    pub session: usize,
    pub turn: usize,
    /// The `x-request-id` header sent (router log: `x_request_id="…"` on `[ROUTING_INPUT]`).
    pub x_request_id: String,
    /// The router's request id (`request_id="…"` on `[ROUTING_INPUT]` / `Selected worker`):
    /// the response `id` without `chatcmpl-` / `cmpl-`. None if the request failed.
    pub router_request_id: Option<String>,
    /// Prompt tokens as the workload computes them (exact with the lab's model fixture).
    pub prompt_tokens: usize,
    /// `usage.prompt_tokens` from the response.
    pub usage_prompt_tokens: Option<u64>,
    pub usage_completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` from the response.
    pub usage_cached_tokens: Option<u64>,
    /// With `fixed_answers` or `stream`: the worker that decoded the reply
    /// (`nvext.worker_id`); with `fixed_answers`, whether the reply's token ids
    /// (`nvext.completion_token_ids`) were the planned ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_as_planned: Option<bool>,
    /// The prefill worker of a disaggregated request (`nvext.worker_id.prefill_worker_id`,
    /// where it differs from the decode worker): its prefill ran remotely. Recorded
    /// with `stream` or `fixed_answers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_worker_id: Option<u64>,
    /// With `stream`: milliseconds from sending to the first chunk carrying reply text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Milliseconds since the workload started, when the request was sent.
    pub sent_at_ms: u64,
    pub latency_ms: u64,
    pub http_status: Option<u16>,
    pub ok: bool,
    pub error: Option<String>,
}

/// What the workload did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkloadSummary {
    pub frontend: String,
    pub model: String,
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    pub elapsed_secs: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Router counters from the frontend's `/metrics`, after minus before the workload
    /// (names `dynamo_component_router_*_total|_sum|_count`, summed over labels).
    pub router_counters_delta: BTreeMap<String, f64>,
    /// Cached prefix tokens the router passed over: delta of
    /// `…_kv_best_eligible_cached_prefix_tokens_total` minus
    /// `…_kv_selected_cached_prefix_tokens_total`. Greater than zero means some requests
    /// went to a worker with less cached prefix than the best eligible one (spills).
    /// (`…_non_max_overlap_selections_total` stays 0 in this frontend: it only counts
    /// when a selection observer is installed.)
    pub router_spilled_cached_tokens: Option<f64>,
    pub requests: Vec<RequestRecord>,
}

impl WorkloadSummary {
    /// The summary without the per-request list.
    pub fn brief(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Some(obj) = v.as_object_mut() {
            obj.remove("requests");
        }
        v
    }

    /// The router's ids of the requests whose reply named one: what its decisions are
    /// keyed by.
    pub fn router_request_ids(&self) -> Vec<String> {
        self.requests
            .iter()
            .filter_map(|r| r.router_request_id.clone())
            .collect()
    }
}

/// splitmix64: tiny, deterministic, good enough for synthetic text.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Vocabulary size of the model fixture's synthetic words.
pub const VOCAB_WORDS: u64 = 2000;

fn words(rng: &mut SplitMix64, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push('w');
        s.push_str(&rng.below(VOCAB_WORDS).to_string());
    }
    s
}

fn stream_rng(seed: u64, kind: u64, a: u64, b: u64) -> SplitMix64 {
    let mut r = SplitMix64::new(seed ^ kind.wrapping_mul(0xA24B_AED4_963E_E407));
    let x = r.next_u64() ^ a.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    let mut r = SplitMix64::new(x);
    let y = r.next_u64() ^ b.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    SplitMix64::new(y)
}

/// The system prompt of family `f`: starts with `w<f>` so families differ from the
/// first block on, then random words.
pub fn system_prompt(seed: u64, family: usize, words_n: usize) -> String {
    let mut rng = stream_rng(seed, 1, family as u64, 0);
    let head = format!("w{}", family as u64 % VOCAB_WORDS);
    format!("{head} {}", words(&mut rng, words_n.saturating_sub(1)))
}

/// Words in family `family`'s system prompt: a document family's `document_words`;
/// else `system_words`, or with `system_words_max` a seeded draw from `system_words ..=
/// system_words_max` (uniform, or log-uniform for a long-tailed shape; never below 256).
pub fn system_words(cfg: &WorkloadConfig, family: usize) -> usize {
    if family + cfg.document_families >= cfg.families.max(1) && cfg.document_families > 0 {
        return cfg.document_words.max(256);
    }
    let low = cfg.system_words.max(256);
    match cfg.system_words_max {
        Some(high) if high > low => {
            let mut rng = stream_rng(cfg.seed, 4, family as u64, 0);
            match cfg.shape {
                PromptShape::Uniform => low + rng.below((high - low + 1) as u64) as usize,
                PromptShape::LongTailed => {
                    let (l, h) = ((low as f64).ln(), (high as f64).ln());
                    ((l + unit(&mut rng) * (h - l)).exp().round() as usize).clamp(low, high)
                }
            }
        }
        _ => low,
    }
}

/// A uniform draw from [0, 1).
fn unit(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// How fast a long-tailed shape's family popularity falls: family `r` (from 1) is
/// chosen with weight `r^-POPULARITY_EXPONENT`. At 0.5 the last of 16 families draws a
/// quarter of the first's sessions: a document shared by a few conversations.
const POPULARITY_EXPONENT: f64 = 0.5;

/// The family of conversation `session`: round-robin, or for a long-tailed shape the
/// first `families` sessions one per family and the rest by popularity (Zipf, see
/// [`POPULARITY_EXPONENT`]), seeded.
pub fn family_of(cfg: &WorkloadConfig, session: usize) -> usize {
    let families = cfg.families.max(1);
    if cfg.shape == PromptShape::Uniform || session < families {
        return session % families;
    }
    let weight = |rank: usize| 1.0 / (rank as f64).powf(POPULARITY_EXPONENT);
    let total: f64 = (1..=families).map(weight).sum();
    let mut x = unit(&mut stream_rng(cfg.seed, 5, session as u64, 0)) * total;
    for f in 0..families {
        x -= weight(f + 1);
        if x < 0.0 {
            return f;
        }
    }
    families - 1
}

/// Words in `session`'s `turn`: `user_words`, or for a long-tailed shape a seeded
/// log-normal draw around it (σ = 1.2: a tenth of the turns over 4.7× the median),
/// from 4 to `user_words_max`.
pub fn user_words(cfg: &WorkloadConfig, session: usize, turn: usize) -> usize {
    match cfg.shape {
        PromptShape::Uniform => cfg.user_words,
        PromptShape::LongTailed => {
            let mut rng = stream_rng(cfg.seed, 6, session as u64, turn as u64);
            // Box–Muller: one standard normal from two uniforms.
            let (u1, u2) = (1.0 - unit(&mut rng), unit(&mut rng));
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            let median = cfg.user_words.max(1) as f64;
            ((median.ln() + 1.2 * z).exp().round() as usize).clamp(4, cfg.user_words_max.max(4))
        }
    }
}

/// Token id of the fixture's word `w0` (`w<n>` is `n + FIRST_WORD_ID`; the ids below are
/// its special tokens).
pub const FIRST_WORD_ID: u32 = 7;

/// The planned reply of `session`'s `turn`: `n` token ids of the fixture's words.
pub fn planned_answer(seed: u64, session: usize, turn: usize, n: u32) -> Vec<u32> {
    let mut rng = stream_rng(seed, 3, session as u64, turn as u64);
    (0..n)
        .map(|_| FIRST_WORD_ID + rng.below(VOCAB_WORDS) as u32)
        .collect()
}

/// The header Dynamo's frontend names a request's session by, for session affinity.
pub const SESSION_HEADER: &str = "x-dynamo-session-id";

/// The session id of a conversation ([`WorkloadConfig::session_ids`]).
pub fn session_id(tag: &str, session: usize) -> String {
    format!("{tag}-s{session}")
}

/// The `x-request-id` of a turn.
pub fn x_request_id(tag: &str, family: usize, session: usize, turn: usize) -> String {
    format!("{tag}-f{family}-s{session}-t{turn}")
}

/// The header values' prefix (`tag`, default `kvs<seed>`).
pub fn request_tag(cfg: &WorkloadConfig) -> String {
    cfg.tag
        .clone()
        .unwrap_or_else(|| format!("kvs{}", cfg.seed))
}

/// The replies `fixed_answers` plans, as the mocker's `--response-replay-trace-path`
/// reads them: one Mooncake JSONL row per turn of every session, keyed by the turn's
/// `x-request-id`, which each request names in its `output_replay_id` annotation.
pub fn answer_trace(cfg: &WorkloadConfig) -> String {
    let tag = request_tag(cfg);
    let mut out = String::new();
    for session in 0..cfg.sessions {
        let family = family_of(cfg, session);
        for turn in 0..cfg.max_turns {
            let ids = planned_answer(cfg.seed, session, turn, cfg.max_tokens);
            let row = json!({
                "request_id": x_request_id(&tag, family, session, turn),
                "output_length": ids.len(),
                "output_token_ids": ids,
            });
            out.push_str(&row.to_string());
            out.push('\n');
        }
    }
    out
}

/// A written [`answer_trace`], removed when dropped (the run it was for is over, or
/// failed to start).
#[derive(Debug)]
pub struct AnswerTraceFile(std::path::PathBuf);

impl AnswerTraceFile {
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for AnswerTraceFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Write [`answer_trace`] of `cfg` under `lab_dir` (`answers/<tag>-<pid>.jsonl`) for the
/// mockers to read at start ([`crate::LabConfig::answering_from`]).
pub fn write_answer_trace(
    cfg: &WorkloadConfig,
    lab_dir: &std::path::Path,
) -> Result<AnswerTraceFile> {
    let dir = lab_dir.join("answers");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{}-{}.jsonl", request_tag(cfg), std::process::id()));
    std::fs::write(&path, answer_trace(cfg))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(AnswerTraceFile(path))
}

/// The user message of `session`'s `turn`.
pub fn user_message(seed: u64, session: usize, turn: usize, words_n: usize) -> String {
    let mut rng = stream_rng(seed, 2, session as u64, turn as u64);
    words(&mut rng, words_n)
}

/// Renders messages like the fixture's chat template (`<|role|> content ` each, then
/// `<|assistant|> `).
pub fn render_prompt(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str(&format!("<|{role}|> {content} "));
    }
    s.push_str("<|assistant|> ");
    s
}

/// Tokens of a rendered conversation with the fixture tokenizer (one per word/marker).
pub fn count_tokens(messages: &[(String, String)]) -> usize {
    messages
        .iter()
        .map(|(_, c)| 1 + c.split_whitespace().count())
        .sum::<usize>()
        + 1
}

struct Shared {
    cfg: WorkloadConfig,
    model: String,
    client: reqwest::Client,
    sem: Semaphore,
    next_slot: Mutex<Instant>,
    start: Instant,
    deadline: Instant,
    tag: String,
}

/// Runs the workload to completion (all turns done, or the duration cap reached).
pub async fn run(cfg: WorkloadConfig) -> Result<WorkloadSummary> {
    if cfg.families == 0 || cfg.sessions == 0 || cfg.concurrency == 0 {
        bail!("families, sessions and concurrency must be > 0");
    }
    let frontend = cfg.frontend.trim_end_matches('/').to_string();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(cfg.request_timeout_secs))
        .pool_max_idle_per_host(cfg.concurrency)
        .build()
        .context("building HTTP client")?;
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => first_model(&client, &frontend).await?,
    };
    let before = scrape_router_counters(&client, &frontend).await;
    let start = Instant::now();
    let tag = request_tag(&cfg);
    info!(
        frontend = %frontend, model = %model, sessions = cfg.sessions, families = cfg.families,
        concurrency = cfg.concurrency, max_turns = cfg.max_turns, "Workload starting."
    );
    let shared = Arc::new(Shared {
        model: model.clone(),
        client: client.clone(),
        sem: Semaphore::new(cfg.concurrency),
        next_slot: Mutex::new(start),
        start,
        deadline: start + Duration::from_secs_f64(cfg.duration_secs),
        tag,
        cfg: WorkloadConfig {
            frontend: frontend.clone(),
            ..cfg.clone()
        },
    });
    let tasks: Vec<_> = (0..cfg.sessions)
        .map(|s| tokio::spawn(run_session(shared.clone(), s)))
        .collect();
    let mut requests = Vec::new();
    for t in futures::future::join_all(tasks).await {
        match t {
            Ok(mut recs) => requests.append(&mut recs),
            Err(e) => warn!(error = %e, "Session task failed."),
        }
    }
    requests.sort_by_key(|r| (r.sent_at_ms, r.session, r.turn));
    let elapsed_secs = start.elapsed().as_secs_f64();
    let after = scrape_router_counters(&client, &frontend).await;
    let router_counters_delta: BTreeMap<String, f64> = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .collect();
    let router_spilled_cached_tokens = match (
        router_counters_delta
            .get("dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total"),
        router_counters_delta.get("dynamo_component_router_kv_selected_cached_prefix_tokens_total"),
    ) {
        (Some(best), Some(selected)) => Some(best - selected),
        _ => None,
    };
    let ok = requests.iter().filter(|r| r.ok).count();
    let summary = WorkloadSummary {
        frontend,
        model,
        sent: requests.len(),
        ok,
        failed: requests.len() - ok,
        elapsed_secs,
        prompt_tokens: requests.iter().map(|r| r.prompt_tokens as u64).sum(),
        completion_tokens: requests
            .iter()
            .filter_map(|r| r.usage_completion_tokens)
            .sum(),
        router_counters_delta,
        router_spilled_cached_tokens,
        requests,
    };
    info!(
        sent = summary.sent, ok = summary.ok, failed = summary.failed,
        router_spilled_cached_tokens = ?summary.router_spilled_cached_tokens, elapsed_secs = format!("{:.1}", elapsed_secs),
        "Workload done."
    );
    Ok(summary)
}

async fn run_session(sh: Arc<Shared>, session: usize) -> Vec<RequestRecord> {
    let cfg = &sh.cfg;
    let family = family_of(cfg, session);
    let mut messages: Vec<(String, String)> = vec![(
        "system".into(),
        system_prompt(cfg.seed, family, system_words(cfg, family)),
    )];
    let mut records = Vec::new();
    for turn in 0..cfg.max_turns {
        if turn > 0 && cfg.think_time_ms > 0 {
            tokio::time::sleep(Duration::from_millis(cfg.think_time_ms)).await;
        }
        messages.push((
            "user".into(),
            user_message(cfg.seed, session, turn, user_words(cfg, session, turn)),
        ));
        // Rate limit: claim the next send slot.
        if let Some(rate) = cfg.rate.filter(|r| *r > 0.0) {
            let slot = {
                let mut next = sh.next_slot.lock().await;
                let slot = (*next).max(Instant::now());
                *next = slot + Duration::from_secs_f64(1.0 / rate);
                slot
            };
            tokio::time::sleep_until(slot.into()).await;
        }
        let Ok(_permit) = sh.sem.acquire().await else {
            break;
        };
        if Instant::now() >= sh.deadline {
            debug!(session, turn, "Duration cap reached; session stops.");
            break;
        }
        let (rec, reply) = send(&sh, family, session, turn, &messages).await;
        let ok = rec.ok;
        records.push(rec);
        match reply {
            Some(reply) if ok => messages.push(("assistant".into(), reply.trim().to_string())),
            _ => break,
        }
    }
    records
}

async fn send(
    sh: &Shared,
    family: usize,
    session: usize,
    turn: usize,
    messages: &[(String, String)],
) -> (RequestRecord, Option<String>) {
    let cfg = &sh.cfg;
    let x_request_id = x_request_id(&sh.tag, family, session, turn);
    let (url, mut body) = match cfg.api {
        Api::Chat => (
            format!("{}/v1/chat/completions", cfg.frontend),
            json!({
                "model": sh.model,
                "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
                "max_tokens": cfg.max_tokens,
                "stream": false,
            }),
        ),
        Api::Completions => (
            format!("{}/v1/completions", cfg.frontend),
            json!({
                "model": sh.model,
                "prompt": render_prompt(messages),
                "max_tokens": cfg.max_tokens,
                "stream": false,
            }),
        ),
    };
    let mut extra_fields = Vec::new();
    if cfg.fixed_answers {
        extra_fields.push("completion_token_ids");
    }
    if cfg.fixed_answers || cfg.stream {
        extra_fields.push("worker_id");
    }
    if !extra_fields.is_empty() {
        body["nvext"] = json!({ "extra_fields": extra_fields });
    }
    if cfg.fixed_answers {
        body["nvext"]["annotations"] = json!([format!("output_replay_id:{x_request_id}")]);
    }
    if cfg.stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({ "include_usage": true });
    }
    let sent_at = Instant::now();
    let mut rec = RequestRecord {
        family,
        session,
        turn,
        x_request_id: x_request_id.clone(),
        router_request_id: None,
        prompt_tokens: count_tokens(messages),
        usage_prompt_tokens: None,
        usage_completion_tokens: None,
        usage_cached_tokens: None,
        worker_id: None,
        answer_as_planned: None,
        prefill_worker_id: None,
        ttft_ms: None,
        sent_at_ms: sent_at.duration_since(sh.start).as_millis() as u64,
        latency_ms: 0,
        http_status: None,
        ok: false,
        error: None,
    };
    let mut post = sh.client.post(&url).header("x-request-id", &x_request_id);
    if cfg.session_ids {
        post = post.header(SESSION_HEADER, session_id(&sh.tag, session));
    }
    let result = post.json(&body).send().await;
    let mut reply = None;
    match result {
        Err(e) => rec.error = Some(format!("request failed: {e}")),
        Ok(resp) => {
            let status = resp.status();
            rec.http_status = Some(status.as_u16());
            let body = if cfg.stream && status.is_success() {
                read_stream(resp, sent_at).await.map(|(v, ttft)| {
                    rec.ttft_ms = ttft;
                    v
                })
            } else {
                match resp.text().await {
                    Err(e) => Err(format!("reading body: {e}")),
                    Ok(text) if !status.is_success() => {
                        Err(format!("HTTP {status}: {}", truncate(&text, 300)))
                    }
                    Ok(text) => {
                        serde_json::from_str::<Value>(&text).map_err(|e| format!("bad JSON: {e}"))
                    }
                }
            };
            match body {
                Err(e) => rec.error = Some(e),
                Ok(v) => {
                    rec.router_request_id =
                        v.get("id").and_then(Value::as_str).map(router_request_id);
                    rec.usage_prompt_tokens =
                        v.pointer("/usage/prompt_tokens").and_then(Value::as_u64);
                    rec.usage_completion_tokens = v
                        .pointer("/usage/completion_tokens")
                        .and_then(Value::as_u64);
                    rec.usage_cached_tokens = v
                        .pointer("/usage/prompt_tokens_details/cached_tokens")
                        .and_then(Value::as_u64);
                    reply = v
                        .pointer("/choices/0/message/content")
                        .or_else(|| v.pointer("/choices/0/text"))
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    let decode = v
                        .pointer("/nvext/worker_id/decode_worker_id")
                        .and_then(Value::as_u64);
                    let prefill = v
                        .pointer("/nvext/worker_id/prefill_worker_id")
                        .and_then(Value::as_u64);
                    rec.worker_id = decode.or(prefill);
                    rec.prefill_worker_id = prefill.filter(|p| decode.is_some_and(|d| d != *p));
                    if cfg.fixed_answers {
                        let planned = planned_answer(cfg.seed, session, turn, cfg.max_tokens);
                        let got: Option<Vec<u32>> = v
                            .pointer("/nvext/completion_token_ids")
                            .and_then(|ids| serde_json::from_value(ids.clone()).ok());
                        rec.answer_as_planned = Some(got.as_ref() == Some(&planned));
                    }
                    rec.ok = reply.is_some() && rec.router_request_id.is_some();
                    if !rec.ok {
                        rec.error = Some(format!(
                            "unexpected body: {}",
                            truncate(&v.to_string(), 300)
                        ));
                    }
                }
            }
        }
    }
    rec.latency_ms = sent_at.elapsed().as_millis() as u64;
    if let Some(e) = &rec.error {
        warn!(x_request_id = %rec.x_request_id, error = %e, "Request failed.");
    }
    (rec, reply)
}

/// Reads a streamed reply (server-sent events, `data: {chunk}` … `data: [DONE]`) into one
/// body shaped like the unstreamed reply's: the chunks' text joined into
/// `choices[0].message.content`, their `completion_token_ids` joined, the last `usage`,
/// `id` and `nvext.worker_id` seen. Also returns the time from `sent_at` to the first
/// chunk carrying text.
async fn read_stream(
    mut resp: reqwest::Response,
    sent_at: Instant,
) -> std::result::Result<(Value, Option<f64>), String> {
    let mut folded = StreamFold::default();
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let chunk = resp
            .chunk()
            .await
            .map_err(|e| format!("reading stream: {e}"))?;
        let Some(chunk) = chunk else { break };
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            if folded.line(line.trim_end()) && folded.ttft_ms.is_none() {
                folded.ttft_ms = Some(sent_at.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    if folded.line(String::from_utf8_lossy(&pending).trim_end()) && folded.ttft_ms.is_none() {
        folded.ttft_ms = Some(sent_at.elapsed().as_secs_f64() * 1e3);
    }
    if let Some(e) = folded.error {
        return Err(e);
    }
    let ttft_ms = folded.ttft_ms;
    Ok((folded.body(), ttft_ms))
}

/// A streamed reply's chunks, folded as they arrive ([`read_stream`]).
#[derive(Default)]
struct StreamFold {
    id: Option<Value>,
    text: String,
    token_ids: Vec<Value>,
    usage: Option<Value>,
    worker_id: Option<Value>,
    ttft_ms: Option<f64>,
    error: Option<String>,
}

impl StreamFold {
    /// Folds one line of the stream; true when it carried reply text.
    fn line(&mut self, line: &str) -> bool {
        let Some(data) = line.strip_prefix("data:").map(str::trim) else {
            return false;
        };
        if data.is_empty() || data == "[DONE]" {
            return false;
        }
        let v: Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => {
                self.error
                    .get_or_insert(format!("bad stream chunk ({e}): {}", truncate(data, 300)));
                return false;
            }
        };
        if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
            self.error
                .get_or_insert(format!("stream error: {}", truncate(&e.to_string(), 300)));
        }
        if let Some(id) = v.get("id") {
            self.id = Some(id.clone());
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(u.clone());
        }
        // Merged: a chunk may name one of the prefill and decode workers only.
        if let Some(serde_json::Value::Object(w)) = v.pointer("/nvext/worker_id") {
            let into = self.worker_id.get_or_insert_with(|| json!({}));
            for (k, id) in w {
                if !id.is_null() {
                    into[k] = id.clone();
                }
            }
        }
        if let Some(Value::Array(ids)) = v.pointer("/nvext/completion_token_ids") {
            self.token_ids.extend(ids.iter().cloned());
        }
        let text = v
            .pointer("/choices/0/delta/content")
            .or_else(|| v.pointer("/choices/0/text"))
            .and_then(Value::as_str)
            .unwrap_or("");
        self.text.push_str(text);
        !text.is_empty()
    }

    fn body(self) -> Value {
        let mut nvext = json!({});
        if let Some(w) = self.worker_id {
            nvext["worker_id"] = w;
        }
        if !self.token_ids.is_empty() {
            nvext["completion_token_ids"] = Value::Array(self.token_ids);
        }
        json!({
            "id": self.id,
            "usage": self.usage,
            // No text streamed: no reply (the request fails as an unstreamed one would).
            "choices": [{ "message": { "content": (!self.text.is_empty()).then_some(self.text) } }],
            "nvext": nvext,
        })
    }
}

/// The router's request id for a response `id` (`chatcmpl-<uuid>` / `cmpl-<uuid>` → `<uuid>`).
pub fn router_request_id(response_id: &str) -> String {
    response_id
        .strip_prefix("chatcmpl-")
        .or_else(|| response_id.strip_prefix("cmpl-"))
        .unwrap_or(response_id)
        .to_string()
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

async fn first_model(client: &reqwest::Client, frontend: &str) -> Result<String> {
    let v: Value = client
        .get(format!("{frontend}/v1/models"))
        .send()
        .await
        .with_context(|| format!("GET {frontend}/v1/models"))?
        .json()
        .await
        .context("parsing /v1/models")?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("{frontend}/v1/models lists no model"))
}

/// Sums `dynamo_component_router_*` counters (`_total`, `_sum`, `_count`) over labels.
/// Empty if `/metrics` is unreachable.
pub async fn scrape_router_counters(
    client: &reqwest::Client,
    frontend: &str,
) -> BTreeMap<String, f64> {
    let Ok(resp) = client.get(format!("{frontend}/metrics")).send().await else {
        return BTreeMap::new();
    };
    let Ok(text) = resp.text().await else {
        return BTreeMap::new();
    };
    parse_router_counters(&text)
}

/// See [`scrape_router_counters`].
pub fn parse_router_counters(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') || !line.starts_with("dynamo_component_router_") {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if !(name.ends_with("_total") || name.ends_with("_sum") || name.ends_with("_count")) {
            continue;
        }
        if let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *out.entry(name.to_string()).or_insert(0.0) += v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_deterministic_and_families_differ() {
        let a = system_prompt(7, 0, 320);
        assert_eq!(a, system_prompt(7, 0, 320));
        let b = system_prompt(7, 1, 320);
        let first = |s: &str| s.split(' ').take(256).collect::<Vec<_>>().join(" ");
        assert_ne!(first(&a), first(&b));
        assert_eq!(a.split(' ').count(), 320);
        assert_eq!(user_message(7, 3, 2, 40), user_message(7, 3, 2, 40));
        assert_ne!(user_message(7, 3, 2, 40), user_message(7, 3, 1, 40));
    }

    #[test]
    fn token_count_matches_rendering() {
        let m = vec![
            ("system".to_string(), "w1 w2 w3".to_string()),
            ("user".to_string(), "w5 w6".to_string()),
        ];
        // <|system|> w1 w2 w3 <|user|> w5 w6 <|assistant|>  (router logged isl_tokens=8)
        assert_eq!(count_tokens(&m), 8);
        assert_eq!(render_prompt(&m).split_whitespace().count(), 8);
    }

    #[test]
    fn folds_a_streamed_reply() {
        let mut f = StreamFold::default();
        let lines = [
            r#"data: {"id":"chatcmpl-a","choices":[{"delta":{"role":"assistant"}}]}"#,
            "",
            r#"data: {"id":"chatcmpl-a","choices":[{"delta":{"content":"w1 "}}],"nvext":{"worker_id":{"prefill_worker_id":3,"decode_worker_id":4}}}"#,
            r#"data: {"id":"chatcmpl-a","choices":[{"delta":{"content":"w2"}}]}"#,
            r#"data: {"id":"chatcmpl-a","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#,
            "data: [DONE]",
        ];
        let texts: Vec<bool> = lines.iter().map(|l| f.line(l)).collect();
        assert_eq!(texts, [false, false, true, true, false, false]);
        assert!(f.error.is_none());
        let v = f.body();
        assert_eq!(v.pointer("/choices/0/message/content").unwrap(), "w1 w2");
        assert_eq!(v.pointer("/usage/prompt_tokens").unwrap(), 9);
        assert_eq!(v.pointer("/nvext/worker_id/prefill_worker_id").unwrap(), 3);
        let mut bad = StreamFold::default();
        bad.line("data: {not json");
        assert!(bad.error.unwrap().contains("bad stream chunk"));
    }

    #[test]
    fn prompt_lengths_spread_when_asked() {
        let cfg = WorkloadConfig {
            system_words: 256,
            system_words_max: Some(6000),
            ..WorkloadConfig::default()
        };
        let n: Vec<usize> = (0..24).map(|f| system_words(&cfg, f)).collect();
        assert!(n.iter().all(|w| (256..=6000).contains(w)));
        assert!(n.iter().collect::<std::collections::BTreeSet<_>>().len() > 20);
        assert_eq!(system_words(&WorkloadConfig::default(), 3), 320);
    }

    #[test]
    fn strips_response_id_prefixes() {
        assert_eq!(router_request_id("chatcmpl-856b716a-f0ee"), "856b716a-f0ee");
        assert_eq!(router_request_id("cmpl-6b3f3ea1-3777"), "6b3f3ea1-3777");
    }

    #[test]
    fn parses_router_counters() {
        let text = "# TYPE x counter\ndynamo_component_router_non_max_overlap_selections_total{a=\"1\"} 2\ndynamo_component_router_non_max_overlap_selections_total{a=\"2\"} 3\ndynamo_component_router_kv_hit_rate_bucket{le=\"1\"} 3\n";
        let m = parse_router_counters(text);
        assert_eq!(
            m["dynamo_component_router_non_max_overlap_selections_total"],
            5.0
        );
        assert_eq!(m.len(), 1);
    }
}
