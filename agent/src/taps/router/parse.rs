//! Parser for the router's log lines (pure).
//!
//! Dynamo 1.6.1 with `DYN_LOG=info,dynamo_kv_router=debug` logs, in tracing's default
//! format (`<RFC 3339 time> <LEVEL> <spans>: <target>: <message> key=value …`):
//!
//! - `[ROUTING_INPUT] request local hashes request_id="…" isl_tokens=41 block_size=16
//!   num_blocks=2 local_hashes=[…]`
//! - `Selected worker router_mode="kv" request_id="…" worker_id=… worker_type=decode
//!   dp_rank=0 logit=… …`
//! - at INFO when the request's route ends, in its `kv_router.route_request` span:
//!   `route request completed request.outcome="success" … request_id=… dp_rank=0
//!   overlap_blocks=20 phase=Aggregated worker_id=…` (the router's view of its choice;
//!   Dynamo 1.4 and 1.5 log the same at DEBUG as it chooses: `[ROUTING] Best: worker_…
//!   dp_rank=0 with 3/23 blocks overlap request_id=… worker_id=… dp_rank=0
//!   overlap_blocks=3 total_blocks=23`)
//! - Dynamo 1.4 and 1.5 at DEBUG under `dynamo_kv_router::scheduling::selector`, before
//!   the choice, one line per worker scored: `Formula for worker_id=… dp_rank=0 with
//!   3.00 effective cached blocks: 41.688 = … request_id="…" worker_type="decode"` (what
//!   the router credited each candidate with; 1.6 only for a disaggregated prefill
//!   choice made past the worker it believed best, `Router selected a worker with lower
//!   KV cache overlap`)
//!
//! and the migration fork (deepinfra/dynamo) adds `KVMIGRATE_SPILL: request routed off
//! the worker holding its KV` (request_id, source, target, tokens, migratable_tokens),
//! `KVMIGRATE: producer handshake obtained`, `KVMIGRATE: producer dispatch failed`,
//! `KVMIGRATE: decoding on target with migrated KV`.
//!
//! With `DYN_LOGGING_JSONL=1` the same events are JSON objects, one per line, their
//! fields as keys; both forms are read ([`parse_json_line`]). JSON lines also carry
//! the W3C trace context of the span they were written in (`trace_id`, `span_id`):
//! the `[ROUTING_INPUT]` line the router's `kv_router.select_worker` span, the INFO
//! `request received` line the frontend's `http-request` span. Both are kept
//! ([`TraceContext`]), so kvscope's spans join the router's traces.
//!
//! ANSI colour is stripped; fields are read as `key=value` pairs after the message
//! marker (quoted values may hold spaces, bracketed lists are one value), never by
//! position. The event's own fields come before the span fields tracing appends, so the
//! first occurrence of a key wins (span fields repeat keys such as `request_id`).

use kvscope_wire::{MigrationLogKind, MigrationLogLine, TraceContext};
use std::collections::BTreeMap;

/// `[ROUTING_INPUT]`: the request's blocks as the router hashed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingInput {
    pub request_id: String,
    pub isl_tokens: u64,
    pub block_size: u32,
    pub local_hashes: Vec<u64>,
    /// The router's span for the choice (JSON lines).
    pub trace: Option<TraceContext>,
    /// The model the request asked for: the HTTP request span's `model` field, which
    /// tracing appends to the line (none when longer than [`MAX_MODEL_NAME`] bytes).
    pub model: Option<String>,
}

/// The longest model name taken from a log line: Dynamo's model names are paths or hub
/// names; a longer field is no name kvscope can key figures by.
pub(crate) const MAX_MODEL_NAME: usize = 512;

/// `Selected worker`: the router's pick.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectedWorker {
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub worker_type: Option<String>,
    pub router_mode: Option<String>,
    pub selection: kvscope_wire::Selection,
}

/// One `Formula for worker_id=…` line: a worker the router scored for a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub request_id: String,
    /// The pool it was scored in (`decode`, `prefill`): a disaggregated request is scored
    /// twice under one id.
    pub worker_type: Option<String>,
    pub candidate: kvscope_wire::RouterCandidate,
}

/// A record of Dynamo's request trace (`DYN_REQUEST_TRACE=1`): one per request, written
/// when the request ends, at any log level. It names the worker and the prompt's blocks
/// as sequence hashes.
#[derive(Debug, Clone, PartialEq)]
pub struct TracedRequest {
    pub request_id: String,
    /// The worker, where the record names one (Dynamo before 1.5 names none: the
    /// request's `Selected worker` line does).
    pub worker: Option<kvscope_wire::WorkerKey>,
    pub isl_tokens: u64,
    pub block_size: u32,
    /// The sequence hashes of the prompt's full blocks (the trace's trailing partial
    /// block dropped).
    pub sequence_hashes: Vec<u64>,
    /// When the frontend received the request (UNIX ns): the decision was made then.
    pub received_ns: u64,
    /// The request's life: its first token, its end, its sizes (its worker set by
    /// [`Self::set_worker`]).
    pub end: kvscope_wire::RequestEnd,
}

impl TracedRequest {
    /// Name the request's worker (the record's own, or where it names none the one the
    /// request's `Selected worker` line named), in its end too, where a prefill worker
    /// that is the same one is none.
    pub(crate) fn set_worker(&mut self, worker: kvscope_wire::WorkerKey) {
        self.worker = Some(worker);
        self.end.worker = worker;
        self.end.prefill_worker = self.end.prefill_worker.filter(|p| *p != worker);
    }
}

/// The request trace's schema name.
pub(crate) const REQUEST_TRACE_SCHEMA: &str = "dynamo.request.trace.v1";

#[derive(Debug, Clone, PartialEq)]
pub enum LineContent {
    RoutingInput(RoutingInput),
    SelectedWorker(SelectedWorker),
    RequestTrace(TracedRequest),
    Migration(MigrationLogLine),
    /// The router's view of a choice, when the request's route ended.
    RouterView(kvscope_wire::RouterView),
    /// The router's view of a choice, as it chose (Dynamo 1.4 and 1.5's DEBUG `[ROUTING]
    /// Best`; 1.6 writes it too, beside its route's end).
    ChoiceView(kvscope_wire::RouterView),
    /// What the router credited one worker with as it scored the request's candidates.
    Candidate(Candidate),
    /// A choice made past the worker the router believed held the most (Dynamo 1.6's
    /// disaggregated prefill router, DEBUG under `dynamo_llm::kv_router::embedded`):
    /// what it credited the worker it chose, and the one it passed over.
    PassedOver {
        chosen: Candidate,
        best: Candidate,
    },
    /// Any other line naming a request and the span it was written in (a JSON line):
    /// where the request sits in the router's traces, e.g. the frontend's `request
    /// received` at INFO; or that line naming the model the request asked for (every
    /// release logs it before the request's routing lines, also for `/v1/completions`,
    /// whose routing lines name no model).
    RequestSpan {
        request_id: String,
        trace: Option<TraceContext>,
        model: Option<String>,
        /// The arrival line's fields, in order (the HTTP request's span's among them:
        /// `x_request_id`, …), where a tenant may be named; none for other lines.
        fields: Vec<(String, String)>,
    },
    /// Any other line: counted, not parsed.
    Other,
}

/// A parsed line: its content, and its timestamp (UNIX ns) when it starts with one.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedLine {
    pub ts_ns: Option<u64>,
    pub content: LineContent,
}

/// Which kind of line a malformed line looked like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineKind {
    RoutingInput,
    SelectedWorker,
    Migration,
    RequestTrace,
    RouterView,
    Candidate,
}

impl LineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LineKind::RoutingInput => "routing_input",
            LineKind::SelectedWorker => "selected_worker",
            LineKind::Migration => "migration",
            LineKind::RequestTrace => "request_trace",
            LineKind::RouterView => "router_view",
            LineKind::Candidate => "router_candidate",
        }
    }
}

/// A line that mentions a decision or migration marker but could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {} line: {reason}", kind.as_str())]
pub struct MalformedLine {
    pub kind: LineKind,
    pub ts_ns: Option<u64>,
    pub reason: String,
}

const ROUTING_INPUT: &str = "[ROUTING_INPUT]";
/// The frontend's INFO line as a request arrives (`dynamo_llm::http::service::metrics`),
/// naming it by the id its routing lines carry, and its model.
const REQUEST_RECEIVED: &str = "request received";
const SELECTED_WORKER: &str = "Selected worker";
/// A request pinned to a worker (session affinity, or a worker named in the request):
/// `Selected pinned worker: worker_type=decode, worker_id=… dp_rank=0, logit: …`, its
/// fields written into the message.
const SELECTED_PINNED_WORKER: &str = "Selected pinned worker:";
const KVMIGRATE: &str = "KVMIGRATE";
/// The route's span closing (Dynamo 1.6, INFO): its fields are the router's view of the
/// choice.
const ROUTE_COMPLETED: &str = "route request completed";
/// Dynamo 1.4 and 1.5's DEBUG line naming the chosen worker and its overlap.
const ROUTING_BEST: &str = "[ROUTING] Best:";
/// Dynamo 1.4 and 1.5's DEBUG line per worker scored (the selector's, whose formula name
/// comes first: `Formula`, or another name for another cost).
const CANDIDATE: &str = " for worker_id=";
/// Dynamo 1.6's DEBUG line when its disaggregated prefill router chose a worker with less
/// of the prompt cached than another (`selected_worker_id`, `selected_overlap_blocks`,
/// `highest_overlap_worker_id`, `highest_overlap_blocks`, their dp ranks), written as it
/// chooses, before the request's view.
const PASSED_OVER: &str = "Router selected a worker with lower KV cache overlap";

/// The fork's migration messages, by the text after which their fields start.
const MIGRATION_MESSAGES: &[(&str, MigrationLogKind)] = &[
    (
        "KVMIGRATE_SPILL: request routed off the worker holding its KV",
        MigrationLogKind::Spill,
    ),
    (
        "KVMIGRATE: producer handshake obtained",
        MigrationLogKind::HandshakeObtained,
    ),
    (
        "KVMIGRATE: producer dispatch failed",
        MigrationLogKind::DispatchFailed,
    ),
    (
        "KVMIGRATE: decoding on target with migrated KV",
        MigrationLogKind::DecodingOnTarget,
    ),
];

/// A request id as kvscope keeps it (a forged megabyte id is no megabyte held; see
/// [`kvscope_wire::bounded_request_id`]).
fn bounded(id: &str) -> String {
    kvscope_wire::bounded_request_id(id).into_owned()
}

/// Parse one log line (with or without its trailing newline): tracing's text format,
/// or a JSON line (`DYN_LOGGING_JSONL=1`, see [`parse_json_line`]).
pub fn parse_line(raw: &str) -> Result<ParsedLine, MalformedLine> {
    let line = strip_ansi(raw);
    let line = line.trim_end_matches(['\n', '\r']);
    if line.trim_start().starts_with('{') {
        if let Some(parsed) = parse_json_line(line.trim_start()) {
            return parsed;
        }
    }
    let ts_ns = line.split_whitespace().next().and_then(line_time_ns);
    let Some((kind, rest)) = marker(line) else {
        return Ok(ParsedLine {
            ts_ns,
            content: LineContent::Other,
        });
    };
    let fields = match rest {
        Some(rest) => Fields::read_message(kind, rest),
        None => Err("unknown KVMIGRATE message".into()),
    };
    content(kind, fields)
        .map(|content| ParsedLine { ts_ns, content })
        .map_err(|reason| MalformedLine {
            kind: kind.line_kind(),
            ts_ns,
            reason,
        })
}

/// A JSON log line (`DYN_LOGGING_JSONL=1`): `time`, `level`, `target`, `message` and
/// the event's fields as keys (numbers or strings: `dp_rank` is a string, `worker_id` a
/// number past 2^53, `local_hashes` the string `"[h1, h2, …]"`). `None` when the line
/// is not a JSON object (it is read as text then).
pub(crate) fn parse_json_line(line: &str) -> Option<Result<ParsedLine, MalformedLine>> {
    let serde_json::Value::Object(obj) = serde_json::from_str::<serde_json::Value>(line).ok()?
    else {
        return None;
    };
    // The request trace: bare on stderr, `{"timestamp", "event"}` in its file sink.
    let trace = if obj.contains_key("schema") {
        Some(serde_json::Value::Object(obj.clone()))
    } else {
        obj.get("event")
            .filter(|e| e.get("schema").is_some())
            .cloned()
    };
    if let Some(t) = trace {
        if t.get("schema").and_then(|s| s.as_str()) == Some(REQUEST_TRACE_SCHEMA) {
            return Some(request_trace(&t));
        }
    }
    let ts_ns = obj
        .get("time")
        .or_else(|| obj.get("timestamp"))
        .and_then(|t| t.as_str())
        .and_then(line_time_ns);
    let message = obj
        .get("message")
        .and_then(|m| m.as_str())
        .unwrap_or_default();
    let text = |k: &str| obj.get(k).and_then(|v| v.as_str());
    let Some((kind, in_message)) = marker(message) else {
        let trace = text("trace_id")
            .zip(text("span_id"))
            .and_then(|(t, s)| TraceContext::parse(t, s));
        return Some(Ok(ParsedLine {
            ts_ns,
            content: match text("request_id").zip(trace) {
                Some((request_id, trace)) => LineContent::RequestSpan {
                    request_id: bounded(request_id),
                    trace: Some(trace),
                    model: None,
                    fields: Vec::new(),
                },
                None => LineContent::Other,
            },
        }));
    };
    let mut pairs: Vec<(String, String)> = obj
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "time" | "level" | "target" | "message"))
        .map(|(k, v)| {
            let text = match v {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (k.clone(), text)
        })
        .collect();
    // Fields a message writes into its own text (a pinned worker's) come after the
    // event's, which win.
    if let Some(Ok(f)) = in_message.map(|m| Fields::read_message(kind, m)) {
        pairs.extend(f.pairs);
    }
    Some(
        content(kind, Ok(Fields { pairs }))
            .map(|content| ParsedLine { ts_ns, content })
            .map_err(|reason| MalformedLine {
                kind: kind.line_kind(),
                ts_ns,
                reason,
            }),
    )
}

fn request_trace(t: &serde_json::Value) -> Result<ParsedLine, MalformedLine> {
    let ts_ns = t
        .get("event_time_unix_ms")
        .and_then(|v| v.as_u64())
        .map(|ms| ms.saturating_mul(1_000_000));
    if t.get("event_type").and_then(|v| v.as_str()) != Some("request_end") {
        return Ok(ParsedLine {
            ts_ns,
            content: LineContent::Other,
        });
    }
    let malformed = |reason: &str| MalformedLine {
        kind: LineKind::RequestTrace,
        ts_ns,
        reason: reason.to_string(),
    };
    let r = t.get("request").ok_or_else(|| malformed("no request"))?;
    let u64_at = |p: &str| r.pointer(p).and_then(|v| v.as_u64());
    let request_id = bounded(
        r.get("request_id")
            .and_then(|v| v.as_str())
            .ok_or_else(|| malformed("no request_id"))?,
    );
    let worker_id =
        u64_at("/worker/decode_worker_id").or_else(|| u64_at("/worker/prefill_worker_id"));
    let dp_rank = u64_at("/worker/decode_dp_rank")
        .or_else(|| u64_at("/worker/prefill_dp_rank"))
        .and_then(|d| u32::try_from(d).ok())
        .unwrap_or(0);
    let block_size = u64_at("/replay/trace_block_size")
        .and_then(|b| u32::try_from(b).ok())
        .filter(|b| *b > 0)
        .ok_or_else(|| malformed("no replay.trace_block_size"))?;
    let isl_tokens = u64_at("/replay/input_length")
        .or_else(|| u64_at("/input_tokens"))
        .ok_or_else(|| malformed("no input length"))?;
    let hashes = r
        .pointer("/replay/input_sequence_hashes")
        .and_then(|v| v.as_array())
        .ok_or_else(|| malformed("no replay.input_sequence_hashes"))?;
    let full = (isl_tokens / u64::from(block_size)) as usize;
    if hashes.len() < full {
        return Err(malformed("fewer sequence hashes than full blocks"));
    }
    let sequence_hashes = hashes[..full]
        .iter()
        .map(|h| h.as_u64())
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| malformed("a sequence hash is not a u64"))?;
    let received_ns = u64_at("/request_received_ms")
        .ok_or_else(|| malformed("no request_received_ms"))?
        .saturating_mul(1_000_000);
    // A time the trace gives as a number of ms; a negative, infinite or missing one is
    // no time (the trace writes null for a request that never produced a token).
    let ms_at = |p: &str| {
        r.pointer(p)
            .and_then(|v| v.as_f64())
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
    };
    let worker = worker_id.map(|worker_id| kvscope_wire::WorkerKey { worker_id, dp_rank });
    let prefill_worker =
        u64_at("/worker/prefill_worker_id").map(|worker_id| kvscope_wire::WorkerKey {
            worker_id,
            dp_rank: u64_at("/worker/prefill_dp_rank")
                .and_then(|d| u32::try_from(d).ok())
                .unwrap_or(0),
        });
    let end = kvscope_wire::RequestEnd {
        request_id: request_id.clone(),
        // Set by the joiner ([`TracedRequest::set_worker`]).
        worker: kvscope_wire::WorkerKey {
            worker_id: 0,
            dp_rank: 0,
        },
        prefill_worker,
        received_ns,
        ttft_ms: ms_at("/ttft_ms"),
        total_ms: ms_at("/total_time_ms"),
        input_tokens: u64_at("/input_tokens").unwrap_or(isl_tokens),
        output_tokens: u64_at("/output_tokens").unwrap_or(0),
        cached_tokens: u64_at("/cached_tokens"),
    };
    Ok(ParsedLine {
        ts_ns,
        content: LineContent::RequestTrace(TracedRequest {
            request_id,
            worker,
            isl_tokens,
            block_size,
            sequence_hashes,
            received_ns,
            end,
        }),
    })
}

/// What a message is, and where its fields start in a text line (`None` for a
/// KVMIGRATE message of an unknown kind).
#[derive(Debug, Clone, Copy)]
enum Marker {
    RoutingInput,
    SelectedWorker,
    SelectedPinnedWorker,
    RouteCompleted,
    RoutingBest,
    Candidate,
    PassedOver,
    RequestReceived,
    Migration(Option<MigrationLogKind>),
}

impl Marker {
    fn line_kind(self) -> LineKind {
        match self {
            Marker::RoutingInput => LineKind::RoutingInput,
            Marker::SelectedWorker | Marker::SelectedPinnedWorker => LineKind::SelectedWorker,
            Marker::RouteCompleted | Marker::RoutingBest => LineKind::RouterView,
            Marker::Candidate | Marker::PassedOver => LineKind::Candidate,
            // Unused: an arrival line is never malformed (see [`content`]).
            Marker::RequestReceived => LineKind::RouterView,
            Marker::Migration(_) => LineKind::Migration,
        }
    }
}

/// The message a line writes, and where its fields start: the marker that comes first
/// in the line (a message precedes its fields, and the span's fields come last, so a
/// marker's words inside a client's field, e.g. its `x-request-id`, never win).
fn marker(text: &str) -> Option<(Marker, Option<&str>)> {
    // (where the message is, its kind, where its fields start)
    let plain = MARKERS
        .iter()
        .filter_map(|(words, m)| text.find(words).map(|at| (at, *m, Some(at + words.len()))));
    // From `worker_id=` on: the fields, and the `with N … cached blocks` words.
    let candidate = candidate_at(text).map(|at| (at, Marker::Candidate, Some(at + " for ".len())));
    let migration = text.find(KVMIGRATE).map(|at| {
        let known = MIGRATION_MESSAGES.iter().find_map(|(msg, kind)| {
            text.find(msg)
                .map(|p| (Marker::Migration(Some(*kind)), Some(p + msg.len())))
        });
        let (m, fields) = known.unwrap_or((Marker::Migration(None), None));
        (at, m, fields)
    });
    plain
        .chain(candidate)
        .chain(migration)
        .min_by_key(|(at, _, _)| *at)
        .map(|(_, m, fields)| (m, fields.map(|f| &text[f..])))
}

/// The messages found by their words alone.
const MARKERS: [(&str, Marker); 7] = [
    (PASSED_OVER, Marker::PassedOver),
    (ROUTING_INPUT, Marker::RoutingInput),
    (SELECTED_PINNED_WORKER, Marker::SelectedPinnedWorker),
    (SELECTED_WORKER, Marker::SelectedWorker),
    (ROUTE_COMPLETED, Marker::RouteCompleted),
    (ROUTING_BEST, Marker::RoutingBest),
    (REQUEST_RECEIVED, Marker::RequestReceived),
];

fn content(kind: Marker, fields: Result<Fields, String>) -> Result<LineContent, String> {
    let fields = match (kind, fields) {
        // Not a line decisions are made of: one kvscope cannot read is just a line.
        (Marker::RequestReceived, Err(_)) => return Ok(LineContent::Other),
        (_, fields) => fields?,
    };
    Ok(match kind {
        Marker::RoutingInput => LineContent::RoutingInput(routing_input(&fields)?),
        Marker::SelectedWorker => match selected_worker(&fields, false)? {
            // The request plane sending the request to a worker chosen before it (by the
            // KV router, whose own line names the choice, or by the client): Dynamo 1.4's
            // push router logs it under the HTTP request's id. Not a choice.
            s if s.router_mode.as_deref() == Some("direct") => LineContent::Other,
            s => LineContent::SelectedWorker(s),
        },
        Marker::SelectedPinnedWorker => {
            LineContent::SelectedWorker(selected_worker(&fields, true)?)
        }
        Marker::RouteCompleted => match router_view(&fields, IdAt::Last)? {
            Some(v) => LineContent::RouterView(v),
            None => LineContent::Other,
        },
        Marker::RoutingBest => match router_view(&fields, IdAt::First)? {
            Some(v) => LineContent::ChoiceView(v),
            None => return Err("no worker_id or overlap_blocks".into()),
        },
        Marker::RequestReceived => request_received(fields),
        Marker::Candidate => match candidate(&fields)? {
            Some(c) => LineContent::Candidate(c),
            None => LineContent::Other,
        },
        Marker::PassedOver => match passed_over(&fields)? {
            Some((chosen, best)) => LineContent::PassedOver { chosen, best },
            None => LineContent::Other,
        },
        Marker::Migration(Some(k)) => LineContent::Migration(migration(k, fields)?),
        Marker::Migration(None) => return Err("unknown KVMIGRATE message".into()),
    })
}

/// The frontend's INFO `request received request_id=… model=…`: the request's model,
/// and in a JSON line the span it was written in. Any other line for one naming no
/// request, or neither.
fn request_received(f: Fields) -> LineContent {
    let (trace, model) = (f.trace(), f.get("model").and_then(model_name));
    match f.get("request_id") {
        Some(id) => LineContent::RequestSpan {
            request_id: bounded(id),
            trace,
            model,
            fields: f.pairs,
        },
        _ => LineContent::Other,
    }
}

/// A model field's value as kvscope keys figures by it: none when empty or longer than
/// [`MAX_MODEL_NAME`].
fn model_name(m: &str) -> Option<String> {
    (!m.is_empty() && m.len() <= MAX_MODEL_NAME).then(|| m.to_string())
}

fn routing_input(f: &Fields) -> Result<RoutingInput, String> {
    let local_hashes = parse_u64_list(f.require("local_hashes")?)?;
    if let Some(n) = f.get("num_blocks") {
        let n: usize = n.parse().map_err(|_| format!("num_blocks={n:?}"))?;
        if n != local_hashes.len() {
            return Err(format!(
                "num_blocks={n} but {} local hashes",
                local_hashes.len()
            ));
        }
    }
    let input = RoutingInput {
        request_id: bounded(f.require("request_id")?),
        isl_tokens: f.parse("isl_tokens")?,
        block_size: f.parse("block_size")?,
        local_hashes,
        trace: f.trace(),
        model: f.get("model").and_then(model_name),
    };
    kvscope_wire::check_prompt_blocks(input.isl_tokens, input.block_size, input.local_hashes.len())
        .map_err(|e| e.to_string())?;
    Ok(input)
}

fn selected_worker(f: &Fields, pinned: bool) -> Result<SelectedWorker, String> {
    Ok(SelectedWorker {
        request_id: bounded(f.require("request_id")?),
        worker_id: f.parse("worker_id")?,
        dp_rank: f.parse_or("dp_rank", 0)?,
        worker_type: f.get("worker_type").map(str::to_string),
        router_mode: f.get("router_mode").map(str::to_string),
        selection: kvscope_wire::Selection {
            // A cost that is no finite number is no cost (the line is still a decision).
            logit: f
                .get("logit")
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|l| l.is_finite()),
            pinned,
            lower_tiers: router_lower_tiers(f),
        },
    })
}

/// The router's extension of the chosen worker's match through its lower tiers, where
/// the line states it (Dynamo 1.6: `host_pinned_blocks=… disk_blocks=…`); a field that
/// is no count is none.
fn router_lower_tiers(f: &Fields) -> Option<kvscope_wire::LowerTierBlocks> {
    let count = |k: &str| f.get(k).and_then(|v| v.parse::<u32>().ok());
    let (host, disk) = (count("host_pinned_blocks"), count("disk_blocks"));
    (host.is_some() || disk.is_some()).then(|| kvscope_wire::LowerTierBlocks {
        host_blocks: host.unwrap_or(0),
        disk_blocks: disk.unwrap_or(0),
    })
}

/// Which of a line's `request_id`s names the decision.
#[derive(Clone, Copy)]
enum IdAt {
    /// The event's own (it comes before the spans' fields).
    First,
    /// The innermost span's: on a route's closing line, tracing writes the enclosing
    /// spans' fields before the route span's own, and the HTTP request's span carries a
    /// `request_id` of its own.
    Last,
}

/// The router's view from a route's closing line or a `[ROUTING] Best` line; `None` for
/// a route that went to no worker (it failed before one was chosen: no `worker_id`, no
/// `overlap_blocks`).
fn router_view(f: &Fields, id_at: IdAt) -> Result<Option<kvscope_wire::RouterView>, String> {
    if f.get("worker_id").is_none() || f.get("overlap_blocks").is_none() {
        return Ok(None);
    }
    Ok(Some(kvscope_wire::RouterView {
        request_id: bounded(match id_at {
            IdAt::First => f.require("request_id")?,
            IdAt::Last => f.require_last("request_id")?,
        }),
        worker: kvscope_wire::WorkerKey {
            worker_id: f.parse("worker_id")?,
            dp_rank: f.parse_or("dp_rank", 0)?,
        },
        overlap_blocks: f.parse("overlap_blocks")?,
        phase: f.get("phase").map(str::to_string),
        // Set by the joiner from the request's score lines.
        candidates: Vec::new(),
    }))
}

/// Where a selector's per-worker line names its worker (`Formula for worker_id=`): the
/// formula's name is one word ending the text before it, and the line states the
/// blocks it credited (`with N … blocks`). `None` for any other line.
fn candidate_at(text: &str) -> Option<usize> {
    let pos = text.find(CANDIDATE)?;
    let name = text[..pos].rsplit(' ').next().unwrap_or_default();
    (name.ends_with("ormula") && text[pos..].contains(" blocks")).then_some(pos)
}

/// A candidate's line: its worker, and the number after `with` (`with 3.00 effective
/// cached blocks`, `with 3 cached blocks`, `with 3 device blocks`). `None` where the line
/// names no request (releases that score in a task without the request's identity write
/// `request_id="-"` or none): it cannot be set beside its view.
fn candidate(f: &Fields) -> Result<Option<Candidate>, String> {
    scored_request(f)
        .map(|id| scored_worker(f, id, ["worker_id", "dp_rank", "with"]))
        .transpose()
}

/// The request a line scoring workers names: none where it names none (`request_id="-"`).
fn scored_request(f: &Fields) -> Option<&str> {
    f.get("request_id")
        .filter(|id| !id.is_empty() && *id != "-")
}

/// One worker as a line scoring workers for `request_id` credits it: by its worker id,
/// dp rank and credit fields (`keys`).
fn scored_worker(f: &Fields, request_id: &str, keys: [&str; 3]) -> Result<Candidate, String> {
    let [worker, dp_rank, credit] = keys;
    let credited_blocks = f
        .get(credit)
        .and_then(|n| n.trim_end_matches([',', ':']).parse::<f64>().ok())
        .filter(|n| n.is_finite() && *n >= 0.0)
        .ok_or_else(|| format!("no {credit} blocks"))?;
    Ok(Candidate {
        request_id: bounded(request_id),
        worker_type: f.get("worker_type").map(str::to_string),
        candidate: kvscope_wire::RouterCandidate {
            worker: kvscope_wire::WorkerKey {
                worker_id: f.parse(worker)?,
                dp_rank: f.parse_or(dp_rank, 0)?,
            },
            credited_blocks,
        },
    })
}

/// A choice made past the worker the router believed best: the chosen worker and the
/// passed-over one as it credited them (`selected_…`, `highest_overlap_…`). `None` where
/// the line names no request.
fn passed_over(f: &Fields) -> Result<Option<(Candidate, Candidate)>, String> {
    let Some(id) = scored_request(f) else {
        return Ok(None);
    };
    let chosen = [
        "selected_worker_id",
        "selected_dp_rank",
        "selected_overlap_blocks",
    ];
    let best = [
        "highest_overlap_worker_id",
        "highest_overlap_dp_rank",
        "highest_overlap_blocks",
    ];
    Ok(Some((
        scored_worker(f, id, chosen)?,
        scored_worker(f, id, best)?,
    )))
}

fn migration(kind: MigrationLogKind, f: Fields) -> Result<MigrationLogLine, String> {
    let opt_u64 = |k: &str| f.get(k).map(|_| f.parse::<u64>(k)).transpose();
    let mut line = MigrationLogLine {
        kind,
        request_id: f.get("request_id").map(bounded),
        source: f.get("source").map(str::to_string),
        target: f.get("target").map(str::to_string),
        tokens: opt_u64("tokens")?,
        migratable_tokens: opt_u64("migratable_tokens")?,
        fields: BTreeMap::new(),
        trace: f.trace(),
    };
    if kind == MigrationLogKind::Spill {
        for k in ["request_id", "source", "target"] {
            f.require(k)?;
        }
    }
    const NAMED: [&str; 9] = [
        "request_id",
        "source",
        "target",
        "tokens",
        "migratable_tokens",
        "trace_id",
        "span_id",
        "parent_id",
        "span_name",
    ];
    for (k, v) in f.pairs {
        if !NAMED.contains(&k.as_str()) {
            line.fields.entry(k).or_insert(v);
        }
    }
    Ok(line)
}

/// The `key=value` pairs of a line, in order.
#[derive(Debug, Default)]
struct Fields {
    pairs: Vec<(String, String)>,
}

impl Fields {
    /// The W3C trace context the line was written in, when it carries a valid one.
    fn trace(&self) -> Option<TraceContext> {
        TraceContext::parse(self.get("trace_id")?, self.get("span_id")?)
    }

    /// [`Self::read`] for a message's fields. A pinned worker's message writes its own
    /// (`worker_type=decode, worker_id=… dp_rank=0, logit: 59.3, …`): commas part them,
    /// and its cost is `logit: N`.
    fn read_message(kind: Marker, s: &str) -> Result<Self, String> {
        match kind {
            Marker::SelectedPinnedWorker => {
                Self::read(&s.replace(',', " ").replace("logit: ", "logit="))
            }
            // `… dp_rank=0 with 3.00 effective cached blocks: …`: the credit, as `with`.
            Marker::Candidate => Self::read(&s.replacen(" with ", " with=", 1)),
            _ => Self::read(s),
        }
    }

    /// Read every `key=value` pair in `s`; words without `=` (the message) are skipped.
    /// Quoted values are unescaped; `[…]` and `{…}` values are kept whole.
    fn read(s: &str) -> Result<Self, String> {
        let b = s.as_bytes();
        let mut pairs = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_whitespace() {
                i += 1;
                continue;
            }
            let start = i;
            while i < b.len() && is_key_byte(b[i]) {
                i += 1;
            }
            if i > start && i < b.len() && b[i] == b'=' {
                let key = s[start..i].to_string();
                i += 1;
                let (value, next) = read_value(s, i).map_err(|e| format!("{key}: {e}"))?;
                pairs.push((key, value));
                i = next;
            } else {
                // A word of the message: skip to the next whitespace.
                while i < b.len() && !b[i].is_ascii_whitespace() {
                    i += 1;
                }
            }
        }
        Ok(Self { pairs })
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The last `key`'s value: the innermost span's, where spans repeat a key.
    fn require_last(&self, key: &str) -> Result<&str, String> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| format!("no {key}"))
    }

    fn require(&self, key: &str) -> Result<&str, String> {
        self.get(key).ok_or_else(|| format!("no {key}"))
    }

    /// [`Self::parse`], or `default` when the line has no `key`.
    fn parse_or<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T, String> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.parse(key),
        }
    }

    fn parse<T: std::str::FromStr>(&self, key: &str) -> Result<T, String> {
        let v = self.require(key)?;
        v.parse().map_err(|_| format!("{key}={v:?}"))
    }
}

fn is_key_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-'
}

/// Read one value starting at byte `i`; returns it and the index after it.
fn read_value(s: &str, i: usize) -> Result<(String, usize), String> {
    let b = s.as_bytes();
    match b.get(i) {
        Some(b'"') => {
            let mut out = String::new();
            let mut chars = s[i + 1..].char_indices();
            while let Some((j, c)) = chars.next() {
                match c {
                    '"' => return Ok((out, i + 1 + j + 1)),
                    '\\' => match chars.next() {
                        Some((_, 'n')) => out.push('\n'),
                        Some((_, 't')) => out.push('\t'),
                        Some((_, 'r')) => out.push('\r'),
                        Some((_, c)) => out.push(c),
                        None => break,
                    },
                    c => out.push(c),
                }
            }
            Err("unterminated quoted value".into())
        }
        Some(&open @ (b'[' | b'{')) => {
            let close = if open == b'[' { b']' } else { b'}' };
            let mut depth = 0usize;
            let mut in_quote = false;
            let mut j = i;
            while j < b.len() {
                let c = b[j];
                if in_quote {
                    if c == b'\\' {
                        j += 1;
                    } else if c == b'"' {
                        in_quote = false;
                    }
                } else if c == b'"' {
                    in_quote = true;
                } else if c == open {
                    depth += 1;
                } else if c == close {
                    depth -= 1;
                    if depth == 0 {
                        return Ok((s[i..=j].to_string(), j + 1));
                    }
                }
                j += 1;
            }
            Err(format!("unterminated {}", open as char))
        }
        _ => {
            let end = b[i..]
                .iter()
                .position(|c| c.is_ascii_whitespace())
                .map_or(b.len(), |p| i + p);
            Ok((s[i..end].to_string(), end))
        }
    }
}

/// `[1, 2, 3]` → numbers.
fn parse_u64_list(v: &str) -> Result<Vec<u64>, String> {
    let inner = v
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .ok_or_else(|| format!("not a list: {}", excerpt(v)))?;
    if inner.trim().is_empty() {
        return Ok(Vec::new());
    }
    inner
        .split(',')
        .map(|x| {
            let x = x.trim();
            x.parse()
                .map_err(|_| format!("not a u64 in the list: {}", excerpt(x)))
        })
        .collect()
}

fn excerpt(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Remove ANSI escape sequences (CSI `ESC [ … final`, and two-byte `ESC x`).
pub fn strip_ansi(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.contains('\x1b') {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('[') => {
                // Parameters and intermediates, then one final byte in @..~.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            Some(']') => {
                // OSC: up to BEL or ESC \.
                while let Some(c) = chars.next() {
                    if c == '\x07' {
                        break;
                    }
                    if c == '\x1b' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    std::borrow::Cow::Owned(out)
}

/// When a log line was written, as the agent orders it. Dynamo stamps lines to the
/// microsecond, engines their batches to a fraction of one: a batch published within
/// the microsecond of a decision line, before it, would be ordered after it (seen on
/// the freshness bench: ~1% of decisions judged without the answer published just
/// before them). So a stamp of microseconds or finer is taken at the *end* of the
/// interval it names; nothing a line reports happens within a microsecond of it. A
/// coarser stamp keeps its start: ending a millisecond or a second later could put a
/// decision after its own prefill.
pub(crate) fn line_time_ns(s: &str) -> Option<u64> {
    let (start, digits) = parse_rfc3339(s)?;
    if digits < 6 {
        return Some(start);
    }
    let span = 10u64.pow(9 - digits.min(9));
    start.checked_add(span - 1)
}

/// `2026-11-29T07:50:01.123456Z` (or with a `+hh:mm` offset) → UNIX nanoseconds.
pub(crate) fn parse_rfc3339_ns(s: &str) -> Option<u64> {
    parse_rfc3339(s).map(|(ns, _)| ns)
}

/// [`parse_rfc3339_ns`], and how many fractional digits the stamp has.
fn parse_rfc3339(s: &str) -> Option<(u64, u32)> {
    let b = s.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut nanos: i64 = 0;
    let mut digits = 0u32;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 9 {
                nanos = nanos * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        if i == start {
            return None;
        }
        digits = (i - start) as u32;
        for _ in (i - start)..9 {
            nanos *= 10;
        }
    }
    let offset_secs = match b.get(i) {
        Some(b'Z') | Some(b'z') if i + 1 == b.len() => 0,
        Some(&sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
            let off = num(i + 1..i + 3)? * 3600 + num(i + 4..i + 6)? * 60;
            if sign == b'+' {
                off
            } else {
                -off
            }
        }
        _ => return None,
    };
    let days = kvscope_kit::clock::days_from_civil(y, mo, d);
    let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset_secs;
    let ns = u64::try_from(secs)
        .ok()?
        .checked_mul(1_000_000_000)?
        .checked_add(nanos as u64)?;
    Some((ns, digits))
}

#[cfg(test)]
mod tests {
    use super::*;

    const INPUT: &str = r#"2026-11-29T07:50:01.123456Z DEBUG http-request:kv_router.select_worker: dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id="r-1" isl_tokens=41 block_size=16 num_blocks=2 local_hashes=[11, 18446744073709551615] method=POST x_request_id="kvs1 with space" request_id=other-id model="m""#;
    const SELECTED: &str = r#"2026-11-29T07:50:01.123556Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode="kv" request_id="r-1" worker_id=758491669810558404 worker_type=decode dp_rank=1 logit=62.625 host_pinned_blocks=3 disk_blocks=1"#;

    #[test]
    fn routing_input_line() {
        let p = parse_line(INPUT).unwrap();
        // The end of the microsecond the line names (see `line_time_ns`).
        assert_eq!(p.ts_ns, Some(1_795_938_601_123_456_999));
        assert_eq!(
            p.content,
            LineContent::RoutingInput(RoutingInput {
                request_id: "r-1".into(),
                isl_tokens: 41,
                block_size: 16,
                local_hashes: vec![11, u64::MAX],
                trace: None,
                model: Some("m".into()),
            })
        );
        // A model field no name could be is left out; the decision stays.
        let long = INPUT.replace("model=\"m\"", &format!("model=\"{}\"", "x".repeat(6000)));
        match parse_line(&long).unwrap().content {
            LineContent::RoutingInput(i) => assert_eq!(i.model, None),
            other => panic!("{other:?}"),
        }
    }

    /// A request under session affinity, as Dynamo 1.6.1's frontend logged it in the lab
    /// (`--router-session-affinity-ttl-secs`): its fields in the message, comma-separated.
    #[test]
    fn selected_pinned_worker_line() {
        let text = r#"2026-12-03T08:49:08.000973Z  INFO dynamo_kv_router::scheduling::selector: Selected pinned worker: worker_type=decode, worker_id=11605553951028822029 dp_rank=0, logit: 59.312, effective cached blocks: 25.00 request_id="ec879ef0-bdb2-475a-9deb-fb2b8edd9eaa""#;
        let want = LineContent::SelectedWorker(SelectedWorker {
            request_id: "ec879ef0-bdb2-475a-9deb-fb2b8edd9eaa".into(),
            worker_id: 11605553951028822029,
            dp_rank: 0,
            worker_type: Some("decode".into()),
            router_mode: None,
            selection: kvscope_wire::Selection {
                logit: Some(59.312),
                pinned: true,
                lower_tiers: None,
            },
        });
        assert_eq!(parse_line(text).unwrap().content, want);
        // The same event as a JSON line: the message as written, the event's field a key.
        let json = r#"{"time":"2026-12-03T08:49:08.000973Z","level":"INFO","target":"dynamo_kv_router::scheduling::selector","message":"Selected pinned worker: worker_type=decode, worker_id=11605553951028822029 dp_rank=0, logit: 59.312, effective cached blocks: 25.00","request_id":"ec879ef0-bdb2-475a-9deb-fb2b8edd9eaa"}"#;
        assert_eq!(parse_line(json).unwrap().content, want);
    }

    #[test]
    fn selected_worker_line() {
        let p = parse_line(SELECTED).unwrap();
        assert_eq!(
            p.content,
            LineContent::SelectedWorker(SelectedWorker {
                request_id: "r-1".into(),
                worker_id: 758491669810558404,
                dp_rank: 1,
                worker_type: Some("decode".into()),
                router_mode: Some("kv".into()),
                selection: kvscope_wire::Selection {
                    logit: Some(62.625),
                    pinned: false,
                    lower_tiers: Some(kvscope_wire::LowerTierBlocks {
                        host_blocks: 3,
                        disk_blocks: 1,
                    }),
                },
            })
        );
        // Fields in another order, dp_rank missing: still parsed by name.
        let p = parse_line("Selected worker worker_id=5 request_id=abc").unwrap();
        assert!(matches!(
            p.content,
            LineContent::SelectedWorker(SelectedWorker {
                worker_id: 5,
                dp_rank: 0,
                ..
            })
        ));
        assert_eq!(p.ts_ns, None);
    }

    #[test]
    fn ansi_colour_is_stripped() {
        let coloured = "\x1b[2m2026-11-29T08:03:31.699280Z\x1b[0m \x1b[32m INFO\x1b[0m \x1b[2mdynamo_kv_router::scheduling::selector\x1b[0m\x1b[2m:\x1b[0m Selected worker \x1b[3mrouter_mode\x1b[0m\x1b[2m=\x1b[0m\"kv\" \x1b[3mrequest_id\x1b[0m\x1b[2m=\x1b[0m\"7c15\" \x1b[3mworker_id\x1b[0m\x1b[2m=\x1b[0m6023921076729307042 \x1b[3mdp_rank\x1b[0m\x1b[2m=\x1b[0m0";
        let p = parse_line(coloured).unwrap();
        assert!(p.ts_ns.is_some());
        assert!(matches!(
            p.content,
            LineContent::SelectedWorker(SelectedWorker {
                worker_id: 6023921076729307042,
                ..
            })
        ));
        assert_eq!(strip_ansi("a\x1b]0;title\x07b\x1b[1;31mc"), "abc");
    }

    #[test]
    fn migration_lines() {
        let spill = r#"2026-11-29T07:50:02Z  INFO dynamo_llm::kv_router::push_router: KVMIGRATE_SPILL: request routed off the worker holding its KV request_id="r-9" source=111 target=222 tokens=20480 migratable_tokens=16384 mode="dry""#;
        let p = parse_line(spill).unwrap();
        let LineContent::Migration(m) = p.content else {
            panic!("{p:?}")
        };
        assert_eq!(m.kind, MigrationLogKind::Spill);
        assert_eq!(m.request_id.as_deref(), Some("r-9"));
        assert_eq!(
            (m.source.as_deref(), m.target.as_deref()),
            (Some("111"), Some("222"))
        );
        assert_eq!((m.tokens, m.migratable_tokens), (Some(20480), Some(16384)));
        assert_eq!(m.fields.get("mode").map(String::as_str), Some("dry"));
        for (line, kind) in [
            (
                "x KVMIGRATE: producer handshake obtained request_id=a source=1",
                MigrationLogKind::HandshakeObtained,
            ),
            (
                "x  WARN y: KVMIGRATE: producer dispatch failed request_id=a error=\"no producer\"",
                MigrationLogKind::DispatchFailed,
            ),
            (
                "x KVMIGRATE: decoding on target with migrated KV",
                MigrationLogKind::DecodingOnTarget,
            ),
        ] {
            let LineContent::Migration(m) = parse_line(line).unwrap().content else {
                panic!("{line}")
            };
            assert_eq!(m.kind, kind);
        }
    }

    #[test]
    fn garbage_lines_are_other_or_malformed() {
        for other in [
            "",
            "\n",
            "garbage",
            "\u{fffd}\u{fffd}",
            "2026-11-29T07:50:01Z INFO request completed request_id=x",
            "a=b=c [unclosed",
        ] {
            assert_eq!(
                parse_line(other).unwrap().content,
                LineContent::Other,
                "{other:?}"
            );
        }
        let bad = [
            (r#"[ROUTING_INPUT] request local hashes request_id="r" isl_tokens=41 block_size=16 num_blocks=2 local_hashes=[1, 2"#, LineKind::RoutingInput),
            (r#"[ROUTING_INPUT] request local hashes request_id="r" isl_tokens=41 block_size=16 num_blocks=3 local_hashes=[1, 2]"#, LineKind::RoutingInput),
            (r#"[ROUTING_INPUT] request local hashes request_id="r" isl_tokens=x block_size=16 local_hashes=[1]"#, LineKind::RoutingInput),
            (r#"[ROUTING_INPUT] request local hashes request_id="r" isl_tokens=41 block_size=16 local_hashes=[1, -2]"#, LineKind::RoutingInput),
            (r#"[ROUTING_INPUT] request local hashes isl_tokens=41 block_size=16 local_hashes=[]"#, LineKind::RoutingInput),
            (r#"[ROUTING_INPUT] request_id="unterminated"#, LineKind::RoutingInput),
            // Four full blocks, two hashes; a block size of 0.
            (r#"[ROUTING_INPUT] request local hashes request_id="r" isl_tokens=64 block_size=16 local_hashes=[1, 2]"#, LineKind::RoutingInput),
            (r#"[ROUTING_INPUT] request local hashes request_id="r" isl_tokens=0 block_size=0 local_hashes=[]"#, LineKind::RoutingInput),
            ("Selected worker request_id=\"r\"", LineKind::SelectedWorker),
            ("Selected worker request_id=\"r\" worker_id=-1", LineKind::SelectedWorker),
            ("Selected worker request_id=\"r\" worker_id=1 dp_rank=x", LineKind::SelectedWorker),
            ("KVMIGRATE_SPILL: request routed off the worker holding its KV request_id=r source=1", LineKind::Migration),
            ("KVMIGRATE_SPILL: request routed off the worker holding its KV request_id=r source=1 target=2 tokens=lots", LineKind::Migration),
            ("KVMIGRATE: something new", LineKind::Migration),
        ];
        for (line, kind) in bad {
            let e = parse_line(line).unwrap_err();
            assert_eq!(e.kind, kind, "{line}");
        }
    }

    #[test]
    fn timestamps() {
        // Ordering takes a microsecond stamp at its end, a finer one as is, a coarser
        // one at its start.
        let at = |s: &str| line_time_ns(s).unwrap() % 1_000_000_000;
        assert_eq!(at("2026-11-29T07:50:01.123456Z"), 123_456_999);
        assert_eq!(at("2026-11-29T07:50:01.123456789Z"), 123_456_789);
        assert_eq!(at("2026-11-29T07:50:01.123Z"), 123_000_000);
        assert_eq!(at("2026-11-29T07:50:01Z"), 0);
        assert_eq!(parse_rfc3339_ns("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ns("1970-01-01T00:00:01.5Z"),
            Some(1_500_000_000)
        );
        assert_eq!(
            parse_rfc3339_ns("2000-03-01T00:00:00Z"),
            Some(951_868_800_000_000_000)
        );
        assert_eq!(
            parse_rfc3339_ns("2026-11-29T08:03:48.326053Z"),
            Some(1_795_939_428_326_053_000)
        );
        assert_eq!(
            parse_rfc3339_ns("2026-11-29T09:03:48.326053+01:00"),
            Some(1_795_939_428_326_053_000)
        );
        for bad in [
            "",
            "2026-11-29",
            "2026-13-29T08:03:48Z",
            "2026-11-29T08:03:48",
            "2026-11-29T08:03:48.Z",
            "1969-12-31T23:59:59Z",
            "２０２６-11-29T08:03:48Z",
        ] {
            assert_eq!(parse_rfc3339_ns(bad), None, "{bad}");
        }
    }

    /// JSON lines carry the span they were written in: a routing line the router's
    /// choice span, any other line naming a request its own span; ids that are not W3C
    /// ids are no context at all.
    #[test]
    fn json_lines_carry_their_trace_context() {
        let input = r#"{"time":"2026-12-01T19:25:47.185336Z","level":"DEBUG","target":"dynamo_kv_router::services::selection::core::run","message":"[ROUTING_INPUT] request local hashes","block_size":16,"isl_tokens":41,"local_hashes":"[11, 12]","num_blocks":2,"parent_id":"4dbab56494688f08","request_id":"r-1","span_id":"C4BB29434DE1F7BC","span_name":"kv_router.select_worker","trace_id":"e3dc865584cf0a24f81738cf84ceb1c7"}"#;
        let LineContent::RoutingInput(r) = parse_line(input).unwrap().content else {
            panic!("a routing line");
        };
        assert_eq!(
            r.trace,
            Some(TraceContext {
                trace_id: "e3dc865584cf0a24f81738cf84ceb1c7".into(),
                span_id: "c4bb29434de1f7bc".into(),
            })
        );
        let received = r#"{"time":"2026-12-01T19:25:47.184114Z","level":"INFO","target":"dynamo_llm::http::service::metrics","message":"request received","request_id":"r-1","span_id":"4dbab56494688f08","span_name":"http-request","trace_id":"e3dc865584cf0a24f81738cf84ceb1c7"}"#;
        let span = |line: &str| match parse_line(line).unwrap().content {
            LineContent::RequestSpan {
                request_id,
                trace,
                model,
                fields,
            } => (request_id, trace, model, fields.len()),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            span(received),
            (
                "r-1".to_string(),
                Some(
                    TraceContext::parse("e3dc865584cf0a24f81738cf84ceb1c7", "4dbab56494688f08")
                        .unwrap()
                ),
                None,
                4
            )
        );
        // A trace context that is none: the request's arrival still, with no span.
        for (t, s) in [
            ("00000000000000000000000000000000", "4dbab56494688f08"),
            ("e3dc865584cf0a24f81738cf84ceb1c7", "0000000000000000"),
            ("e3dc865584cf0a24f81738cf84ceb1c", "4dbab56494688f08"),
            ("e3dc865584cf0a24f81738cf84ceb1cz", "4dbab56494688f08"),
        ] {
            let line = received
                .replace("e3dc865584cf0a24f81738cf84ceb1c7", t)
                .replace("4dbab56494688f08", s);
            assert_eq!(span(&line).1, None, "{t} {s}");
        }
    }

    #[test]
    fn never_panics_on_cut_lines() {
        for base in [INPUT, SELECTED] {
            for (i, _) in base.char_indices() {
                let _ = parse_line(&base[..i]);
                let _ = parse_line(&base[i..]);
            }
        }
    }

    /// The route's closing line names the request twice in text (the HTTP request's span,
    /// then the route's): the route's id is the one its decision has, and the view is
    /// read under it. In JSON the key is written once.
    #[test]
    fn route_completed_lines_are_the_routers_view() {
        let text = r#"2026-12-06T05:57:00.206020Z  INFO http-request:kv_router.route_request: request_span: route request completed request.outcome="success" method=POST uri=/v1/chat/completions version=HTTP/1.1 x_request_id="kvs1-f0-s0-t0" request_id=247660f3-d7fe-4f78-9042-e4fe70e6b26e model="kvscope-tiny" otel.kind="client" request_id=2b3170e8-a945-4ada-a214-4c47af885a52 dp_rank=0 overlap_blocks=7 phase=Aggregated worker_id=7847800910559599967 request.attempt=0 migration.is_retry=false migration.tokens_completed=0 request.outcome="success""#;
        let want = kvscope_wire::RouterView {
            request_id: "2b3170e8-a945-4ada-a214-4c47af885a52".into(),
            worker: kvscope_wire::WorkerKey {
                worker_id: 7847800910559599967,
                dp_rank: 0,
            },
            overlap_blocks: 7,
            phase: Some("Aggregated".into()),
            candidates: Vec::new(),
        };
        assert_eq!(
            parse_line(text).unwrap().content,
            LineContent::RouterView(want.clone())
        );
        let json = r#"{"time":"2026-12-01T09:46:14.110401Z","level":"INFO","target":"request_span","message":"route request completed","dp_rank":"0","otel.kind":"client","overlap_blocks":"7","phase":"Aggregated","request.outcome":"success","request_id":"2b3170e8-a945-4ada-a214-4c47af885a52","span_name":"kv_router.route_request","worker_id":"7847800910559599967"}"#;
        assert_eq!(
            parse_line(json).unwrap().content,
            LineContent::RouterView(want.clone())
        );
        // Dynamo 1.4 and 1.5 at DEBUG, as the router chooses.
        let best = r#"2026-12-06T05:59:12.247404Z DEBUG http-request:kv_router.select_worker: dynamo_llm::kv_router::push_router::selection: [ROUTING] Best: worker_7847800910559599967 dp_rank=0 with 7/23 blocks overlap request_id=2b3170e8-a945-4ada-a214-4c47af885a52 worker_id=7847800910559599967 dp_rank=0 overlap_blocks=7 total_blocks=23 method=POST uri=/v1/chat/completions version=HTTP/1.1 x_request_id="kvs1-f0-s0-t0""#;
        assert_eq!(
            parse_line(best).unwrap().content,
            LineContent::ChoiceView(kvscope_wire::RouterView {
                phase: None,
                ..want.clone()
            })
        );
        // A route that failed before a worker was chosen is no view.
        let failed = r#"2026-12-06T05:57:00.206020Z  INFO http-request:kv_router.route_request: request_span: route request completed request.outcome="error" request_id=2b3170e8"#;
        assert_eq!(parse_line(failed).unwrap().content, LineContent::Other);
        // A view whose figures are no numbers is malformed, and said so.
        let bad = text.replace("overlap_blocks=7", "overlap_blocks=many");
        assert_eq!(parse_line(&bad).unwrap_err().kind, LineKind::RouterView);
    }

    /// Dynamo 1.6.1's disaggregated prefill router passing over the worker it believed
    /// best, as it wrote it (text and JSON): the chosen and the passed-over worker with
    /// their credits; a line naming no request is none; one without its figures
    /// malformed.
    #[test]
    fn a_choice_past_the_believed_best_names_both_workers() {
        let text = r#"2026-12-07T12:34:28.494048Z DEBUG dynamo_llm::kv_router::embedded: Router selected a worker with lower KV cache overlap request_id="0db12805-1ff6-4bcd-bed6-647f25f985e0" worker_type="prefill" selected_worker_id=11840306891121132110 selected_dp_rank=0 selected_overlap_blocks=0.0 highest_overlap_worker_id=11396365133843937557 highest_overlap_dp_rank=1 highest_overlap_blocks=20.0 overlap_blocks_lost=20.0"#;
        let side = |worker_id: u64, dp_rank: u32, blocks: f64| Candidate {
            request_id: "0db12805-1ff6-4bcd-bed6-647f25f985e0".into(),
            worker_type: Some("prefill".into()),
            candidate: kvscope_wire::RouterCandidate {
                worker: kvscope_wire::WorkerKey { worker_id, dp_rank },
                credited_blocks: blocks,
            },
        };
        let want = LineContent::PassedOver {
            chosen: side(11840306891121132110, 0, 0.0),
            best: side(11396365133843937557, 1, 20.0),
        };
        assert_eq!(parse_line(text).unwrap().content, want);
        let json = r#"{"time":"2026-12-07T12:34:28.494048Z","level":"DEBUG","target":"dynamo_llm::kv_router::embedded","message":"Router selected a worker with lower KV cache overlap","request_id":"0db12805-1ff6-4bcd-bed6-647f25f985e0","worker_type":"prefill","selected_worker_id":11840306891121132110,"selected_dp_rank":0,"selected_overlap_blocks":0.0,"highest_overlap_worker_id":11396365133843937557,"highest_overlap_dp_rank":1,"highest_overlap_blocks":20.0,"overlap_blocks_lost":20.0}"#;
        assert_eq!(parse_line(json).unwrap().content, want);
        let unkeyed = text.replace(
            r#"request_id="0db12805-1ff6-4bcd-bed6-647f25f985e0""#,
            r#"request_id="-""#,
        );
        assert_eq!(parse_line(&unkeyed).unwrap().content, LineContent::Other);
        let bad = text.replace("highest_overlap_blocks=20.0", "highest_overlap_blocks=lots");
        assert_eq!(parse_line(&bad).unwrap_err().kind, LineKind::Candidate);
        // A client's header that spells the line is a field of another line, no more: the
        // marker written first wins.
        let forged = format!(
            r#"2026-12-07T12:34:28Z DEBUG http-request:kv_router.select_worker: dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id="r" isl_tokens=32 block_size=16 num_blocks=2 local_hashes=[1, 2] x_request_id="{}""#,
            text.split(": ").nth(1).unwrap().replace('"', "'")
        );
        assert!(
            matches!(
                parse_line(&forged).unwrap().content,
                LineContent::RoutingInput(_)
            ),
            "{forged}"
        );
    }

    /// Dynamo 1.4.1's selector line per worker scored, as its router wrote it: the worker,
    /// the blocks credited, the request and the pool; the other wordings its releases
    /// use; a line naming no request is none.
    #[test]
    fn score_lines_are_candidates() {
        let line = r#"2026-12-07T09:30:16.027580Z DEBUG dynamo_kv_router::scheduling::selector: Formula for worker_id=12375151454799782876 dp_rank=0 with 20.00 effective cached blocks: 46.688 = prefill_load_scale * adjusted_prefill_blocks + decode_blocks + active_request_cost_blocks = 1.000 * 2.688 + 44.000 + 0.000 (raw_prefill_blocks: 22.688, overlap_credit_blocks: 20.000, overlap_credit_decay: 1.000) request_id="3a676b3b-2878-45a1-841d-d14239501258" worker_type="decode""#;
        let want = |blocks: f64, pool: Option<&str>| Candidate {
            request_id: "3a676b3b-2878-45a1-841d-d14239501258".into(),
            worker_type: pool.map(str::to_string),
            candidate: kvscope_wire::RouterCandidate {
                worker: kvscope_wire::WorkerKey {
                    worker_id: 12375151454799782876,
                    dp_rank: 0,
                },
                credited_blocks: blocks,
            },
        };
        assert_eq!(
            parse_line(line).unwrap().content,
            LineContent::Candidate(want(20.0, Some("decode")))
        );
        // Other releases' wordings: a whole count, device blocks with shared ones beyond,
        // a pinned worker's formula.
        for (text, blocks) in [
            ("Formula for worker_id=12375151454799782876 dp_rank=0 with 3 cached blocks: 41.000 = 1.0 * 20.000 + 21.000", 3.0),
            ("Formula for worker_id=12375151454799782876 dp_rank=0 with 4 device blocks, 2 shared blocks beyond device (reduction=0.5, multiplier=1.00): 40.000", 4.0),
            ("Pinned formula for worker_id=12375151454799782876 dp_rank=0 with 7.50 effective cached blocks: 12.000", 7.5),
        ] {
            let line = format!(
                r#"2026-12-07T09:30:16Z DEBUG dynamo_kv_router::scheduling::selector: {text} request_id="3a676b3b-2878-45a1-841d-d14239501258""#
            );
            assert_eq!(
                parse_line(&line).unwrap().content,
                LineContent::Candidate(want(blocks, None)),
                "{text}"
            );
        }
        // Scored where the request's identity is not known: nothing to set it beside.
        let unkeyed = line.replace(
            r#"request_id="3a676b3b-2878-45a1-841d-d14239501258""#,
            r#"request_id="-""#,
        );
        assert_eq!(parse_line(&unkeyed).unwrap().content, LineContent::Other);
        let bare = line.split(" request_id=").next().unwrap();
        assert_eq!(parse_line(bare).unwrap().content, LineContent::Other);
        // A credit that is no number is malformed, and said so.
        let bad = line.replace("with 20.00", "with many");
        assert_eq!(parse_line(&bad).unwrap_err().kind, LineKind::Candidate);
        // Other text naming a worker is no score.
        let other = r#"2026-12-07T09:30:16Z  INFO x: Event processor for worker_id=5 started with 3 blocks"#;
        assert_eq!(parse_line(other).unwrap().content, LineContent::Other);
        // JSON lines: the same score.
        let json = r#"{"time":"2026-12-07T09:30:16.027580Z","level":"DEBUG","target":"dynamo_kv_router::scheduling::selector","message":"Formula for worker_id=12375151454799782876 dp_rank=0 with 20.00 effective cached blocks: 46.688 = 1.000 * 2.688 + 44.000","request_id":"3a676b3b-2878-45a1-841d-d14239501258","worker_type":"decode"}"#;
        assert_eq!(
            parse_line(json).unwrap().content,
            LineContent::Candidate(want(20.0, Some("decode")))
        );
    }

    fn sample(name: &str) -> String {
        std::fs::read_to_string(format!(
            "{}/../lab/fixtures/samples/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    }

    /// The frontend logs captured from the lab, plain and coloured: every decision line
    /// parses, and both renderings give the same counts.
    #[test]
    fn captured_router_logs_parse() {
        let mut counts = Vec::new();
        for name in ["router_log_plain.log", "router_log_ansi.log"] {
            let text = sample(name);
            let (mut inputs, mut selected, mut other, mut views) = (0, 0, 0, 0);
            for line in text.lines() {
                match parse_line(line)
                    .unwrap_or_else(|e| panic!("{name}: {e}: {line}"))
                    .content
                {
                    LineContent::RoutingInput(r) => {
                        assert_eq!(r.block_size, 16);
                        assert_eq!(r.local_hashes.len() as u64, r.isl_tokens / 16);
                        assert!(!r.request_id.is_empty());
                        inputs += 1;
                    }
                    LineContent::SelectedWorker(s) => {
                        assert_eq!(s.worker_type.as_deref(), Some("decode"));
                        assert_eq!(s.router_mode.as_deref(), Some("kv"));
                        selected += 1;
                    }
                    LineContent::RouterView(v) => {
                        assert_eq!(v.phase.as_deref(), Some("Aggregated"));
                        views += 1;
                    }
                    LineContent::Migration(_)
                    | LineContent::RequestTrace(_)
                    | LineContent::ChoiceView(_)
                    | LineContent::Candidate(_)
                    | LineContent::PassedOver { .. } => {
                        panic!("no migration, trace, DEBUG view or score lines in this capture")
                    }
                    LineContent::Other | LineContent::RequestSpan { .. } => other += 1,
                }
            }
            assert!(
                inputs > 0 && selected > 0 && other > 0 && views > 0,
                "{name}"
            );
            counts.push((name, inputs, selected, views));
        }
        eprintln!("{counts:?}");
    }
}
