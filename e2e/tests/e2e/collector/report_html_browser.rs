//! The HTML opportunity report in a real browser. `kvscope-collector report --out` writes
//! the page from a recording of a synthetic fleet; Debian's headless Chromium opens it
//! from disk, and
//!
//! - its DOM holds every plot with as many marks as the JSON report implies, each point
//!   carrying the JSON's value,
//! - a screenshot is kept as a CI artifact (`target/ci-artifacts/report.png`),
//! - Chromium's net log shows no request and no host lookup made for the page. A control
//!   page with one external image shows the same check catches a request. Chromium's own
//!   background requests (component updates, account checks) carry no page origin and are
//!   listed, not counted; `--host-resolver-rules` keeps even those on the machine.
//!
//! Needs `/usr/bin/chromium` (Debian: `apt-get install chromium`).

use kvscope_collector::report::OpportunityReport;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_wire::hashing::{local_block_hashes, sequence_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::recording::RecordingWriter;
use kvscope_wire::{
    AgentCounters, AgentHeartbeat, Envelope, KvEvent, KvEventBatch, MigrationLogKind,
    MigrationLogLine, Record, RoutingDecision, SequenceStatus, WorkerKey,
};
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHROMIUM: &str = "/usr/bin/chromium";
const S: u64 = 1_000_000_000;
const T0: u64 = 1_700_000_000 * S;
const BLOCK: u32 = 16;
const WORKERS: u64 = 3;

/// splitmix64: deterministic pseudo-random numbers.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Conversation `conv` at turn `turn`: a distinct 256-token opening, then 64 tokens a turn.
fn prompt(conv: u64, turn: u64) -> Vec<u32> {
    (0..256 + 64 * turn)
        .map(|k| (mix(conv << 32 | k) % 150_000) as u32)
        .collect()
}

/// Twelve seconds of a 3-worker fleet: eight conversations growing a turn per request,
/// routed to their home worker most of the time and elsewhere otherwise (a spill, with
/// part of the prefix sometimes already on the chosen worker), each prefill stored as the
/// engine would store it (only the blocks the worker lacked, chained to its cached
/// parent), heartbeats each second and a few migration log lines.
fn fleet_records() -> Vec<Envelope> {
    let mut out = Vec::new();
    let env = |t: u64, record| Envelope {
        agent: "node-a".into(),
        observed_ns: t,
        record,
    };
    let key = |w: u64| WorkerKey {
        worker_id: 100 + w,
        dp_rank: 0,
    };
    let mut cached: Vec<HashSet<u64>> = vec![HashSet::new(); WORKERS as usize];
    let mut seq = [0u64; WORKERS as usize];
    let mut turns = [0u64; 8];
    for i in 0..120u64 {
        let t = T0 + i * S / 10;
        let conv = i % 8;
        turns[conv as usize] += 1;
        let tokens = prompt(conv, turns[conv as usize]);
        let locals = local_block_hashes(&tokens, BLOCK as usize, DYNAMO_HASH_SEED);
        let chain = sequence_hashes(&locals);
        let home = conv % WORKERS;
        let chosen = if mix(i ^ 0xABCD) % 10 < 7 {
            home
        } else {
            (home + 1 + mix(i) % 2) % WORKERS
        };
        out.push(env(
            t,
            Record::Decision(RoutingDecision {
                tenant: None,
                model: None,
                request_id: format!("req-{i}"),
                worker: key(chosen),
                isl_tokens: tokens.len() as u64,
                block_size: BLOCK,
                local_hashes: locals.clone(),
                sequence_hashes: None,
                worker_type: None,
                router_mode: None,
                clock_behind_ms: None,
                selection: Default::default(),
                trace: None,
            }),
        ));
        let c = &mut cached[chosen as usize];
        let have = chain.iter().take_while(|h| c.contains(h)).count();
        if have < chain.len() {
            c.extend(&chain[have..]);
            let s = &mut seq[chosen as usize];
            let sequence = if *s == 0 {
                SequenceStatus::First
            } else {
                SequenceStatus::InOrder
            };
            *s += 1;
            out.push(env(
                t + 20_000_000,
                Record::KvEvents(KvEventBatch {
                    worker: key(chosen),
                    publisher: format!("tcp://10.0.0.{chosen}:5557"),
                    origin: Default::default(),
                    seq: *s,
                    sequence,
                    engine_ts: (t / S) as f64,
                    events: vec![KvEvent::BlockStored {
                        block_hashes: chain[have..].to_vec(),
                        parent_block_hash: have.checked_sub(1).map(|p| chain[p]),
                        token_ids: tokens[have * BLOCK as usize..chain.len() * BLOCK as usize]
                            .to_vec(),
                        block_size: BLOCK,
                        local_hashes: None,
                        lora_name: None,
                        medium: Some("GPU".into()),
                        cache_salt: None,
                    }],
                }),
            ));
        }
        if chosen != home && i % 3 == 0 {
            out.push(env(
                t + 1_000_000,
                Record::Migration(MigrationLogLine {
                    kind: MigrationLogKind::Spill,
                    request_id: Some(format!("req-{i}")),
                    source: Some(key(home).to_string()),
                    target: Some(key(chosen).to_string()),
                    tokens: Some(tokens.len() as u64),
                    migratable_tokens: Some(have as u64 * u64::from(BLOCK)),
                    fields: BTreeMap::new(),
                    trace: None,
                }),
            ));
        }
        if i % 10 == 9 {
            out.push(env(
                t + 50_000_000,
                Record::Heartbeat(AgentHeartbeat {
                    counters: AgentCounters {
                        decisions_joined: i + 1,
                        ..Default::default()
                    },
                    buffered: 0,
                }),
            ));
        }
    }
    out.push(env(
        T0 + 13 * S,
        Record::Heartbeat(AgentHeartbeat::default()),
    ));
    out
}

/// One element of a serialized DOM: tag name and attributes, or a closing tag.
#[derive(Debug)]
enum Tag {
    Open(String, BTreeMap<String, String>),
    Close(String),
}

/// The tags of Chromium's `--dump-dom` output, in order. Enough for a serialized DOM,
/// which escapes `<` in text and `"` in attribute values.
fn tags(dom: &str) -> Vec<Tag> {
    let b = dom.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(off) = dom[i..].find('<') {
        i += off + 1;
        let close = b.get(i) == Some(&b'/');
        if close {
            i += 1;
        }
        let name_end = dom[i..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .map_or(dom.len(), |e| i + e);
        let name = dom[i..name_end].to_ascii_lowercase();
        i = name_end;
        if name.is_empty() {
            continue;
        }
        if close {
            out.push(Tag::Close(name));
            continue;
        }
        let mut attrs = BTreeMap::new();
        loop {
            while b
                .get(i)
                .is_some_and(|c| c.is_ascii_whitespace() || *c == b'/')
            {
                i += 1;
            }
            match b.get(i) {
                None => break,
                Some(b'>') => {
                    i += 1;
                    break;
                }
                _ => {}
            }
            let key_end = dom[i..]
                .find(|c: char| c == '=' || c == '>' || c.is_ascii_whitespace())
                .map_or(dom.len(), |e| i + e);
            let k = dom[i..key_end].to_string();
            i = key_end;
            let mut v = String::new();
            if b.get(i) == Some(&b'=') && b.get(i + 1) == Some(&b'"') {
                let end = dom[i + 2..].find('"').map_or(dom.len(), |e| i + 2 + e);
                v = dom[i + 2..end].to_string();
                i = end + 1;
            }
            attrs.insert(k, v);
        }
        out.push(Tag::Open(name, attrs));
    }
    out
}

/// What one plot holds in the DOM.
#[derive(Debug, Default)]
struct Plot {
    attrs: BTreeMap<String, String>,
    /// Attributes of each `class="mark …"` element inside it.
    marks: Vec<BTreeMap<String, String>>,
}

fn plots(tags: &[Tag]) -> BTreeMap<String, Plot> {
    let mut out: BTreeMap<String, Plot> = BTreeMap::new();
    let mut current: Option<String> = None;
    for t in tags {
        match t {
            Tag::Open(name, a) if name == "svg" => {
                let id = a.get("id").cloned().unwrap_or_default();
                out.entry(id.clone()).or_default().attrs = a.clone();
                current = Some(id);
            }
            Tag::Close(name) if name == "svg" => current = None,
            Tag::Open(_, a) => {
                let is_mark = a
                    .get("class")
                    .is_some_and(|c| c.split_whitespace().any(|c| c == "mark"));
                if let (true, Some(id)) = (is_mark, &current) {
                    out.entry(id.clone()).or_default().marks.push(a.clone());
                }
            }
            Tag::Close(_) => {}
        }
    }
    out
}

/// Network activity Chromium's net log records, split by whether the page caused it.
#[derive(Debug, Default)]
struct NetActivity {
    /// Requests and host lookups made for the page (its origin, `file://`, in their
    /// initiator or network isolation key).
    page: Vec<String>,
    /// Chromium's own background requests: no initiating origin, not keyed to the page.
    browser: Vec<String>,
}

fn net_activity(net_log: &Path) -> NetActivity {
    let text = std::fs::read_to_string(net_log)
        .unwrap_or_else(|e| panic!("no net log at {}: {e}", net_log.display()));
    let log: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("net log {} is not JSON: {e}", net_log.display()));
    let names: BTreeMap<u64, String> = log["constants"]["logEventTypes"]
        .as_object()
        .expect("net log constants name the event types")
        .iter()
        .map(|(k, v)| (v.as_u64().unwrap_or(u64::MAX), k.clone()))
        .collect();
    let events = log["events"].as_array().expect("net log has events");
    let mut out = NetActivity::default();
    for e in events {
        let name = e["type"]
            .as_u64()
            .and_then(|t| names.get(&t))
            .map_or("", String::as_str);
        let p = &e["params"];
        let s = |k: &str| p[k].as_str().unwrap_or("");
        match name {
            "URL_REQUEST_START_JOB" => {
                let url = s("url");
                if url.is_empty() || url.starts_with("file:") || url.starts_with("data:") {
                    continue;
                }
                let keyed_to_page = s("network_isolation_key").contains("file:")
                    || s("site_for_cookies").contains("file:");
                let short = url.split('?').next().unwrap_or(url);
                let line = format!("{} {short} (initiator {:?})", s("method"), s("initiator"));
                if s("initiator") == "not an origin" && !keyed_to_page {
                    out.browser.push(line);
                } else {
                    out.page.push(line);
                }
            }
            "HOST_RESOLVER_MANAGER_REQUEST" if s("network_anonymization_key").contains("file:") => {
                out.page.push(format!("host lookup {}", s("host")));
            }
            _ => {}
        }
    }
    out
}

fn require_chromium() {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: the HTML report test needs Debian's Chromium \
         (apt-get install chromium)"
    );
}

/// Runs headless Chromium on `page` with `action` (`--dump-dom`, `--screenshot=…`),
/// logging the network to `net_log`. Returns stdout.
fn chromium(work: &Path, name: &str, page: &Path, action: &[String], net_log: &Path) -> String {
    let stdout_path = work.join(format!("{name}.stdout"));
    let stderr_path = work.join(format!("{name}.stderr"));
    let mut cmd = Command::new(CHROMIUM);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND",
    ])
    .arg(format!(
        "--user-data-dir={}",
        work.join(format!("{name}-profile")).display()
    ))
    .arg(format!("--log-net-log={}", net_log.display()))
    .args(action)
    .arg(format!("file://{}", page.display()))
    .stdin(Stdio::null())
    .stdout(File::create(&stdout_path).unwrap())
    .stderr(File::create(&stderr_path).unwrap());
    // Chromium forks renderer and utility processes: its own process group, stopped
    // (all of it) when this returns or panics.
    let mut procs = StopOnDrop::default();
    procs.push(
        ManagedProcess::spawn_with_stdio(name, cmd).unwrap_or_else(|e| {
            panic!("cannot start {CHROMIUM}: {e:#} (apt-get install chromium)")
        }),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(st) = procs[0].exited() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "chromium ({name}) did not finish in 90 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    procs.stop(Duration::from_secs(5));
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(
        status.success(),
        "chromium ({name}) failed: {status}\n{stderr}"
    );
    std::fs::read_to_string(&stdout_path).unwrap()
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert!(
        png.len() > 24 && png[..8] == *b"\x89PNG\r\n\x1a\n" && png[12..16] == *b"IHDR",
        "not a PNG"
    );
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&png[16..20]), be(&png[20..24]))
}

fn artifacts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ci-artifacts")
}

fn number(s: &str) -> f64 {
    s.parse()
        .unwrap_or_else(|e| panic!("{s:?} is not a number: {e}"))
}

#[test]
fn the_html_report_renders_its_plots_in_chromium_without_network() {
    require_chromium();
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path();
    let recording = work.join("fleet.jsonl");
    let mut w = RecordingWriter::append(&recording).unwrap();
    for e in fleet_records() {
        w.write(&e).unwrap();
    }
    w.flush().unwrap();

    // The report command writes the page beside the Markdown and JSON.
    let out = work.join("report");
    let collector = kvscope_e2e::collector();
    let common = ["--window-secs", "1", "--warmup-secs", "2"];
    // The what-if at the report's end: the fleet's size (its recording has no discovery)
    // and NIXL figures given, so that migration is priced.
    let whatif = [
        "--gpu-blocks",
        "256",
        "--kv-bytes-per-token",
        "256",
        "--nixl-bandwidth-gbps",
        "5",
        "--handshake-ms",
        "2",
        "--prefill-tok-per-s",
        "2000",
    ];
    let written = Command::new(&collector)
        .args(common)
        .args(["report", "--replay"])
        .arg(&recording)
        .args(whatif)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        written.status.success(),
        "report --out failed: {}",
        String::from_utf8_lossy(&written.stderr)
    );
    let page = out.join("report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(out.join("report.md").exists());
    let report: OpportunityReport =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let printed = Command::new(&collector)
        .args(common)
        .args(["report", "--format", "html", "--replay"])
        .arg(&recording)
        .args(whatif)
        .output()
        .unwrap();
    assert!(printed.status.success());
    assert_eq!(
        String::from_utf8(printed.stdout).unwrap(),
        html,
        "--format html prints the page --out writes"
    );

    // The fleet gave the page something to draw.
    assert!(
        report.windows_measured >= 6,
        "{} measured",
        report.windows_measured
    );
    assert!(report.spills > 0 && report.true_delta_tokens.count > 0);
    assert!(
        report.true_delta_tokens.mean < report.upper_bound_tokens.mean,
        "some spills had part of the prefix on the chosen worker"
    );
    assert!(report.migration_log.spill_lines > 0);
    let whatif = report.whatif.as_ref().expect("the report's what-if");
    assert!(
        whatif.migration.recorded_gates[0].migrations > 0,
        "the what-if priced and migrated the recorded spills"
    );

    // Statically: nothing in the page points anywhere.
    for needle in [
        "http://", "https://", "//", "@import", "url(", "<script", "<img", "<iframe",
    ] {
        assert!(!html.contains(needle), "the page holds {needle:?}");
    }

    // The DOM as Chromium built it.
    let dom_log = work.join("dom.netlog.json");
    let dom = chromium(work, "dom", &page, &["--dump-dom".into()], &dom_log);
    let tags = tags(&dom);
    let plots = plots(&tags);
    let expect = [
        (
            "plot-spill-rate",
            report
                .windows
                .iter()
                .filter(|w| w.spill_rate.is_some())
                .count(),
        ),
        (
            "plot-spill-tokens",
            report
                .spill_token_bins
                .iter()
                .map(|b| {
                    usize::from(b.true_delta_spills > 0) + usize::from(b.upper_bound_spills > 0)
                })
                .sum(),
        ),
        ("plot-volume", 3 * report.windows.len()),
        ("plot-whatif-reserve", whatif.capacity.rows.len()),
        (
            "plot-whatif-migration",
            whatif.migration.rows.len() * (whatif.migration.rows[0].gates.len() + 1),
        ),
    ];
    for (id, marks) in expect {
        let p = plots
            .get(id)
            .unwrap_or_else(|| panic!("no <svg id={id}> in the DOM"));
        assert!(marks > 0, "{id}: the report implies no marks");
        assert_eq!(p.attrs.get("class").map(String::as_str), Some("plot"));
        assert_eq!(
            number(&p.attrs["data-marks"]) as usize,
            marks,
            "{id} data-marks"
        );
        assert_eq!(p.marks.len(), marks, "{id}: marks in the DOM");
        assert!(!p.attrs.contains_key("data-empty"), "{id} is empty");
        println!("{id}: {marks} marks");
    }
    for m in &plots["plot-spill-rate"].marks {
        let w = &report.windows[number(&m["data-window"]) as usize];
        assert_eq!(Some(number(&m["data-value"])), w.spill_rate);
    }
    for m in &plots["plot-volume"].marks {
        let w = &report.windows[number(&m["data-window"]) as usize];
        let v = number(&m["data-value"]);
        let c = &m["class"];
        let want = if c.contains("true-delta") {
            w.true_delta_tok_per_s
        } else if c.contains("upper-bound") {
            w.upper_bound_tok_per_s
        } else {
            w.uncached_prefill_tok_per_s
        };
        assert_eq!(v, want, "{c}");
    }
    for m in &plots["plot-spill-tokens"].marks {
        let from = number(&m["data-from-tokens"]) as u64;
        let b = report
            .spill_token_bins
            .iter()
            .find(|b| b.from_tokens == from)
            .unwrap();
        let want = if m["class"].contains("true-delta") {
            b.true_delta_spills
        } else {
            b.upper_bound_spills
        };
        assert_eq!(number(&m["data-value"]) as u64, want);
    }
    for m in &plots["plot-whatif-reserve"].marks {
        let reserve = number(&m["data-reserve"]);
        let row = whatif
            .capacity
            .rows
            .iter()
            .find(|r| r.reserve == reserve)
            .unwrap();
        assert_eq!(number(&m["data-value"]), row.hit_rate);
    }
    for m in &plots["plot-whatif-migration"].marks {
        let reserve = number(&m["data-reserve"]);
        let row = whatif
            .migration
            .rows
            .iter()
            .find(|r| r.reserve == reserve)
            .unwrap();
        let want = match m.get("data-gate") {
            Some(g) => {
                let g = number(g) as u64;
                row.gates
                    .iter()
                    .find(|o| o.gate_tokens == g)
                    .unwrap()
                    .net_prefill_tok_per_s
            }
            None => -row.reserve_cost_tok_per_s,
        };
        assert_eq!(number(&m["data-value"]), want, "{m:?}");
    }
    let workers: Vec<&BTreeMap<String, String>> = tags
        .iter()
        .filter_map(|t| match t {
            Tag::Open(n, a) if n == "tr" && a.contains_key("data-worker") => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(workers.len(), report.workers.len());
    assert_eq!(workers.len() as u64, WORKERS);
    for k in report.workers.keys() {
        assert!(
            workers.iter().any(|a| a["data-worker"] == k.to_string()),
            "worker {k} has a row"
        );
    }
    assert!(dom.contains("data-state=\"ready\""));

    // A screenshot, kept for CI with the page itself.
    let artifacts = artifacts_dir();
    std::fs::create_dir_all(&artifacts).unwrap();
    std::fs::write(artifacts.join("report.html"), &html).unwrap();
    let shot = artifacts.join("report.png");
    let _ = std::fs::remove_file(&shot);
    let shot_log = work.join("shot.netlog.json");
    chromium(
        work,
        "screenshot",
        &page,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1280,2000".into(),
        ],
        &shot_log,
    );
    let png = std::fs::read(&shot).expect("chromium wrote the screenshot");
    assert_eq!(png_size(&png), (1280, 2000));
    // A blank 1280×2000 page compresses to a few kB; text and plots do not.
    assert!(
        png.len() > 40_000,
        "screenshot looks blank ({} bytes)",
        png.len()
    );
    println!(
        "screenshot: {}",
        shot.canonicalize().unwrap_or(shot.clone()).display()
    );

    // No network: neither Chromium run made a request or a host lookup for the page.
    let mut background = std::collections::BTreeSet::new();
    for log in [&dom_log, &shot_log] {
        let net = net_activity(log);
        assert!(
            net.page.is_empty(),
            "the report made network requests: {:#?}",
            net.page
        );
        background.extend(net.browser);
    }
    for r in background {
        println!("chromium's own background request, not from the page: {r}");
    }
    // The check is not vacuous: a page with one external image is caught.
    let control = work.join("control.html");
    std::fs::write(
        &control,
        "<!DOCTYPE html><html><body><img src=\"http://kvscope-canary.invalid/pixel.png\"></body></html>",
    )
    .unwrap();
    let control_log = work.join("control.netlog.json");
    chromium(
        work,
        "control",
        &control,
        &["--dump-dom".into()],
        &control_log,
    );
    let net = net_activity(&control_log);
    assert!(
        net.page
            .iter()
            .any(|r| r.contains("http://kvscope-canary.invalid/pixel.png")),
        "the net log check missed the control page's request: {net:#?}"
    );
    println!("browser test took {:.1} s", started.elapsed().as_secs_f64());
}
