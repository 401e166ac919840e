//! Just enough parsing of the Dynamo frontend's log to check a lab run (the agent has
//! the real follower). Lines look like (ANSI colour removed):
//!
//! ```text
//! 2026-…Z DEBUG http-request:…:kv_router.select_worker: dynamo_kv_router::services::selection::core::run: [ROUTING_INPUT] request local hashes request_id="6b3f…" isl_tokens=41 block_size=16 num_blocks=2 local_hashes=[4224658329715597812, 12189482240189876293] method=POST uri=/v1/completions version=HTTP/1.1 x_request_id="my-req-1" request_id=6c4f…
//! 2026-…Z  INFO dynamo_kv_router::scheduling::selector: Selected worker router_mode="kv" request_id="6b3f…" worker_id=16535633006403613042 worker_type=decode dp_rank=0 logit=4.5625 host_pinned_blocks=0 disk_blocks=0
//! ```
//!
//! Span fields follow the event's own fields, so a key can repeat (`request_id` above:
//! the first is the router's id, the later one the HTTP span's); [`fields`] keeps the
//! first occurrence.

use std::collections::HashMap;
use std::path::Path;

/// Removes ANSI escape sequences (CSI `ESC [ … final-byte`).
pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// `key=value` pairs of a (colour-free) line, first occurrence wins. Values may be
/// `"quoted"` (quotes removed) or `[bracketed, lists]` (kept as is).
pub fn fields(line: &str) -> HashMap<String, String> {
    let mut map = HashMap::new();
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        // Find '=' preceded by a key.
        if bytes[i] == b'=' {
            let mut k = i;
            while k > 0 && is_key_byte(bytes[k - 1]) {
                k -= 1;
            }
            let key_ok = k < i && (k == 0 || bytes[k - 1] == b' ');
            let (value, end) = read_value(line, i + 1);
            if key_ok {
                map.entry(line[k..i].to_string()).or_insert(value);
            }
            i = end.max(i + 1);
            continue;
        }
        i += 1;
    }
    map
}

fn is_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.'
}

fn read_value(line: &str, start: usize) -> (String, usize) {
    let bytes = line.as_bytes();
    match bytes.get(start) {
        Some(b'"') => {
            let mut j = start + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                if bytes[j] == b'\\' {
                    j += 1;
                }
                j += 1;
            }
            let end = j.min(bytes.len());
            (line[start + 1..end].to_string(), (end + 1).min(bytes.len()))
        }
        Some(b'[') => {
            let end = line[start..]
                .find(']')
                .map(|p| start + p + 1)
                .unwrap_or(bytes.len());
            (line[start..end].to_string(), end)
        }
        _ => {
            let end = line[start..]
                .find(' ')
                .map(|p| start + p)
                .unwrap_or(bytes.len());
            (line[start..end].to_string(), end)
        }
    }
}

/// One `Selected worker` decision.
#[derive(Debug, Clone, PartialEq)]
pub struct SelectedWorker {
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub logit: Option<f64>,
}

/// Parses a `Selected worker` line (with or without colour).
pub fn parse_selected_worker(line: &str) -> Option<SelectedWorker> {
    if !line.contains("Selected worker") {
        return None;
    }
    let line = strip_ansi(line);
    let f = fields(&line);
    Some(SelectedWorker {
        request_id: f.get("request_id")?.clone(),
        worker_id: f.get("worker_id")?.parse().ok()?,
        dp_rank: f.get("dp_rank").and_then(|v| v.parse().ok()).unwrap_or(0),
        logit: f.get("logit").and_then(|v| v.parse().ok()),
    })
}

/// Worker ids from the router's `Adding worker WorkerWithDpRank { worker_id: N, dp_rank: R }`
/// lines (emitted when the KV router learns of a worker).
pub fn parse_added_worker(line: &str) -> Option<(u64, u32)> {
    let rest = &line[line.find("Adding worker WorkerWithDpRank")?..];
    let id = rest
        .split("worker_id: ")
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let rank = rest
        .split("dp_rank: ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    Some((id, rank))
}

/// All `Selected worker` decisions in a log file, by router request id.
pub fn selected_workers(path: &Path) -> std::io::Result<HashMap<String, SelectedWorker>> {
    let bytes = std::fs::read(path)?;
    let text = String::from_utf8_lossy(&bytes);
    Ok(text
        .lines()
        .filter_map(parse_selected_worker)
        .map(|s| (s.request_id.clone(), s))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const COLOURED: &str = "\u{1b}[2m2026-11-29T07:53:26.165927Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m \u{1b}[2mdynamo_kv_router::scheduling::selector\u{1b}[0m\u{1b}[2m:\u{1b}[0m Selected worker \u{1b}[3mrouter_mode\u{1b}[0m\u{1b}[2m=\u{1b}[0m\"kv\" \u{1b}[3mrequest_id\u{1b}[0m\u{1b}[2m=\u{1b}[0m\"6b3f3ea1-3777-425b-ab1d-c3e5e1483b2b\" \u{1b}[3mworker_id\u{1b}[0m\u{1b}[2m=\u{1b}[0m16535633006403613042 \u{1b}[3mworker_type\u{1b}[0m\u{1b}[2m=\u{1b}[0mdecode \u{1b}[3mdp_rank\u{1b}[0m\u{1b}[2m=\u{1b}[0m0 \u{1b}[3mlogit\u{1b}[0m\u{1b}[2m=\u{1b}[0m4.5625";

    #[test]
    fn parses_coloured_selected_worker() {
        let s = parse_selected_worker(COLOURED).unwrap();
        assert_eq!(s.request_id, "6b3f3ea1-3777-425b-ab1d-c3e5e1483b2b");
        assert_eq!(s.worker_id, 16535633006403613042);
        assert_eq!(s.dp_rank, 0);
        assert_eq!(s.logit, Some(4.5625));
    }

    #[test]
    fn first_field_wins_and_lists_survive() {
        let f = fields("x: [ROUTING_INPUT] request local hashes request_id=\"a\" isl_tokens=41 local_hashes=[1, 2] uri=/v1/completions x_request_id=\"k-1\" request_id=b");
        assert_eq!(f["request_id"], "a");
        assert_eq!(f["local_hashes"], "[1, 2]");
        assert_eq!(f["x_request_id"], "k-1");
        assert_eq!(f["isl_tokens"], "41");
    }

    #[test]
    fn parses_added_worker() {
        let l = "2026-11-29T07:53:42.695268Z  WARN dynamo_kv_router::sequences::multi_worker: Adding worker WorkerWithDpRank { worker_id: 16535633006403613042, dp_rank: 0 }";
        assert_eq!(parse_added_worker(l), Some((16535633006403613042, 0)));
    }
}
