//! What a real fleet can do to an agent that used to stop it silently, each reproduced
//! on the real processes (`kvscope agent`, `nats-server -js`, every socket on
//! 127.0.0.1): the agent keeps working or says so — `/readyz` 503 with the reason, a
//! counter — and once the fault is gone it goes on by itself, with no restart.
//!
//! - The router log's link re-pointed at `/dev/zero`, then at a FIFO, then back: the
//!   agent refuses both (not regular files), `/readyz` names the log and why, not a byte
//!   of the device is read, and the decisions written meanwhile arrive once the link is
//!   back, none twice.
//! - A FIFO and a 40 MB file in the discovery folder: skipped, counted, never waited on;
//!   a worker registered after them still appears; the agent's memory stays bounded. A
//!   discovered model name of 8,000 characters: its subjects carry a shortened token
//!   (a NATS server drops a client that sends a control line over 4 KiB), counted.
//! - A replay socket answering 60 batches of 16 MB: the answer is cut at the agent's
//!   byte budget (64 MiB), counted, its memory bounded.
//! - 50 decisions with 1 MB request ids: each id kept as its first bytes and a hash,
//!   counted, the agent's and the collector's memory bounded.
//! - A bus whose storage is wiped: see its test.
//! - An agent's host clock 55 s ahead (libfaketime): the collector learns its offset
//!   from when the stream stored its records, names it on `/metrics`, and neither the
//!   watermark nor the healthy agent's records move.
//! - 300 idle connections, a header sent a byte a second and a 390 KB header to the
//!   collector's and the agent's HTTP listeners: closed within the header timeout, the
//!   connections over the cap closed at once (counted), the big header refused; both go
//!   on answering.

use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// An HTTP GET that gives up after 10 s: a daemon that stops answering fails the test
/// instead of hanging it.
async fn get(url: &str) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?
        .get(url)
        .send()
        .await
}

/// A `kvscope agent` (on its own NATS, or on one given), serving `/metrics` and
/// `/readyz`.
struct Agent {
    _procs: StopOnDrop,
    pid: u32,
    http: String,
    nats: Option<NatsServer>,
}

fn start_agent(dir: &Path, args: &[&str]) -> Agent {
    let nats = NatsServer::start_anywhere(dir).expect("nats-server starts");
    let mut agent = start_agent_on(dir, &nats.url(), args);
    agent.nats = Some(nats);
    agent
}

fn start_agent_on(dir: &Path, nats_url: &str, args: &[&str]) -> Agent {
    start_agent_as(dir, nats_url, "hostile", 0, args)
}

/// An agent named `id` whose host's clock reads `clock_offset_ms` off this one's
/// (libfaketime), its log `<id>.log` in `dir`.
fn start_agent_as(
    dir: &Path,
    nats_url: &str,
    id: &str,
    clock_offset_ms: i64,
    args: &[&str],
) -> Agent {
    let held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let listen = format!("127.0.0.1:{}", held.ports()[0]);
    let mut cmd = Command::new(kvscope_e2e::kvscope());
    cmd.args(["agent", "--agent-id", id, "--cluster", "hostile"])
        .args(["--nats-url", nats_url])
        .args(["--metrics-listen", &listen])
        .args(args);
    if clock_offset_ms != 0 {
        kvscope_lab::skew_clock(&mut cmd, clock_offset_ms).unwrap();
    }
    drop(held);
    let log = if id == "hostile" {
        "agent".to_string()
    } else {
        id.to_string()
    };
    let p = ManagedProcess::spawn(id, cmd, &dir.join(format!("{log}.log"))).unwrap();
    let pid = p.pid();
    Agent {
        _procs: StopOnDrop(vec![p]),
        pid,
        http: format!("http://{listen}"),
        nats: None,
    }
}

/// A `kvscope collector run` on `nats_url`, its HTTP base once it answers.
async fn start_collector(dir: &Path, nats_url: &str) -> (StopOnDrop, String) {
    start_collector_with(dir, nats_url, &[]).await
}

/// [`start_collector`] with more flags.
async fn start_collector_with(dir: &Path, nats_url: &str, extra: &[&str]) -> (StopOnDrop, String) {
    let held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let listen = format!("127.0.0.1:{}", held.ports()[0]);
    let mut cmd = Command::new(kvscope_e2e::kvscope());
    cmd.args(["collector", "run", "--cluster", "hostile"])
        .args(["--nats-url", nats_url])
        .args(["--listen", &listen])
        .args(extra);
    drop(held);
    let p = StopOnDrop(vec![ManagedProcess::spawn(
        "collector",
        cmd,
        &dir.join("collector.log"),
    )
    .unwrap()]);
    // Answering, and serving: it holds its scope's lease once it has read the stream.
    let api = kvscope_lab::daemons::CollectorApi::new(&listen);
    api.wait_summary("the collector to serve", Duration::from_secs(30), "", |s| {
        s["bus"]["lease"]["role"] != "standby"
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    (p, api.base().to_string())
}

/// The body of a GET of `url`.
async fn text(url: &str) -> String {
    get(url).await.unwrap().text().await.unwrap()
}

/// The collector's `/api/summary`.
async fn summary(base: &str) -> serde_json::Value {
    get(&format!("{base}/api/summary"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Wait (at most 60 s) until `f` holds of the collector's summary; the summary.
async fn summary_until(
    base: &str,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = summary(base).await;
        if f(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {:#}", s["bus"]);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

impl Agent {
    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let r = get(&format!("{}{path}", self.http)).await.ok()?;
        let status = r.status().as_u16();
        Some((status, r.text().await.ok()?))
    }

    /// The value of the agent's counter `name` (`kvscope_agent_<name>_total`).
    async fn counter(&self, name: &str) -> Option<f64> {
        let (_, text) = self.get("/metrics").await?;
        let prefix = format!("kvscope_agent_{name}_total{{");
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    /// Wait (at most 30 s) until `/readyz` answers `status` with a body containing
    /// every one of `says`; the body.
    async fn readyz_until(&self, status: u16, says: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = None;
        while Instant::now() < deadline {
            if let Some((s, body)) = self.get("/readyz").await {
                if s == status && says.iter().all(|w| body.contains(w)) {
                    return body;
                }
                last = Some((s, body));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("/readyz never answered {status} with {says:?}; last: {last:?}");
    }

    async fn counter_until(&self, name: &str, at_least: f64) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = self.counter(name).await.unwrap_or(0.0);
            if v >= at_least {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{name} stayed at {v}, below {at_least}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Resident memory, in MiB.
    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap();
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kb / 1024.0
    }
}

/// A decision as Dynamo 1.6.1's router logs it: its routing input and its choice.
fn decision_lines(request_id: &str) -> String {
    decision_lines_at("2026-12-05T07:50:01.123Z", request_id)
}

/// A decision logged at `time` (RFC 3339).
fn decision_lines_at(time: &str, request_id: &str) -> String {
    format!(
        "{time} DEBUG kv_router.select_worker: dynamo_kv_router::services::selection::core::run: \
         [ROUTING_INPUT] request local hashes request_id=\"{request_id}\" isl_tokens=41 block_size=16 \
         num_blocks=2 local_hashes=[11, 12] model=\"m\"\n\
         {time}  INFO dynamo_kv_router::scheduling::selector: Selected worker \
         router_mode=\"kv\" request_id=\"{request_id}\" worker_id=7 worker_type=decode dp_rank=0 logit=1.5\n"
    )
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
}

/// Point the link `link` at `to`, atomically (as `ln -sfn` through a rename does).
fn repoint(link: &Path, to: &Path) {
    let tmp = link.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(to, &tmp).unwrap();
    std::fs::rename(&tmp, link).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_log_pointed_at_a_device_or_a_fifo_is_refused_said_and_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("frontend.log");
    let link = dir.path().join("router.log");
    append(&real, "");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let agent = start_agent(
        dir.path(),
        &["--router-log", link.to_str().unwrap(), "--from-start"],
    );
    agent.readyz_until(200, &["ready"]).await;
    append(&real, &decision_lines("r-1"));
    agent.counter_until("decisions_joined", 1.0).await;

    repoint(&link, Path::new("/dev/zero"));
    let body = agent
        .readyz_until(
            503,
            &["router_log", "not a regular file (a character device)"],
        )
        .await;
    eprintln!("/readyz with the log on /dev/zero:\n{body}");
    // The same on /metrics, for an alert (KvscopeNotReady).
    let (_, metrics) = agent.get("/metrics").await.unwrap();
    assert!(
        metrics.contains("kvscope_agent_not_ready{check=\"router_log\"} 1"),
        "{metrics}"
    );
    let fifo: PathBuf = dir.path().join("fifo");
    if Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        repoint(&link, &fifo);
        agent
            .readyz_until(503, &["router_log", "not a regular file (a FIFO)"])
            .await;
    }
    // Written while the link pointed away; read once it is back, from where it was.
    append(&real, &decision_lines("r-2"));
    repoint(&link, &real);
    agent.readyz_until(200, &["ready"]).await;
    append(&real, &decision_lines("r-3"));
    agent.counter_until("decisions_joined", 3.0).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        agent.counter("decisions_joined").await,
        Some(3.0),
        "r-1 not read twice"
    );
    assert_eq!(
        agent.counter("log_lines_too_long").await,
        Some(0.0),
        "not a byte of /dev/zero was read"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_or_a_huge_file_in_the_discovery_folder_is_skipped_never_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("discovery");
    let bucket = store.join("v1/instances");
    std::fs::create_dir_all(&bucket).unwrap();
    let agent = start_agent(
        dir.path(),
        &[
            "--discovery",
            "file",
            "--discovery-root",
            store.to_str().unwrap(),
        ],
    );
    agent.readyz_until(200, &["ready"]).await;
    let rss_before = agent.rss_mib();
    assert!(Command::new("mkfifo")
        .arg(bucket.join("stuck"))
        .status()
        .unwrap()
        .success());
    let huge = std::fs::File::create(bucket.join("huge")).unwrap();
    huge.set_len(40 << 20).unwrap();
    // Every read counts both (each poll reads the store whole).
    agent.counter_until("discovery_entries_skipped", 4.0).await;
    // A worker registering after them is still seen: discovery was not stopped.
    let changes = agent.counter("discovery_changes").await.unwrap_or(0.0);
    // The store the lab's Dynamo 1.6.1 wrote: three workers with their publishers, one
    // of them serving a model whose name is 8,000 characters (too long for a NATS
    // subject: a server drops the connection of a client that sends one).
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../lab/fixtures/samples/discovery/v1");
    let mut renamed = false;
    for b in std::fs::read_dir(&sample).unwrap() {
        let b = b.unwrap();
        let to = store.join("v1").join(b.file_name());
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(b.path()).unwrap() {
            let f = f.unwrap();
            let mut doc: serde_json::Value =
                serde_json::from_slice(&std::fs::read(f.path()).unwrap()).unwrap();
            if b.file_name() == "mdc" && !std::mem::replace(&mut renamed, true) {
                doc["card_json"]["display_name"] = "m".repeat(8000).into();
            }
            std::fs::write(to.join(f.file_name()), doc.to_string()).unwrap();
        }
    }
    agent
        .counter_until("discovery_changes", changes + 3.0)
        .await;
    agent.counter_until("model_names_shortened", 1.0).await;
    // Its records leave: the worker records (one per worker) are published.
    agent.counter_until("published", 3.0).await;
    agent.readyz_until(200, &["ready"]).await;
    assert_eq!(agent.counter("publish_errors").await, Some(0.0));
    let rss_after = agent.rss_mib();
    eprintln!("agent RSS {rss_before:.1} → {rss_after:.1} MiB beside a 40 MB entry");
    assert!(
        rss_after < rss_before + 20.0,
        "the 40 MB entry was held: {rss_before:.1} → {rss_after:.1} MiB"
    );
}

/// `n` connections to `addr` that send nothing; how many the server has closed within
/// `within`.
async fn idle_connections_closed(addr: &str, n: usize, within: Duration) -> usize {
    use tokio::io::AsyncReadExt;
    let mut conns = Vec::new();
    for _ in 0..n {
        conns.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let deadline = tokio::time::Instant::now() + within;
    let mut closed = 0;
    for mut c in conns {
        let mut b = [0u8; 64];
        if let Ok(Ok(0) | Err(_)) = tokio::time::timeout_at(deadline, c.read(&mut b)).await {
            closed += 1;
        }
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_slow_and_huge_http_clients_are_cut_off_and_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("router.log");
    append(&log, "");
    let agent = start_agent(dir.path(), &["--router-log", log.to_str().unwrap()]);
    agent.readyz_until(200, &["ready"]).await;
    let nats_url = agent.nats.as_ref().unwrap().url();
    let (_collector, collector) = start_collector(dir.path(), &nats_url).await;
    let listen = collector.trim_start_matches("http://").to_string();
    for (name, addr) in [
        ("collector", listen.as_str()),
        ("agent", agent.http.trim_start_matches("http://")),
    ] {
        // Idle: more than the cap; each closed by the header timeout, those over the
        // cap at once.
        let closed = idle_connections_closed(addr, 300, Duration::from_secs(20)).await;
        assert_eq!(closed, 300, "{name}: idle connections left open");
        // A header a byte a second: closed by the header timeout, not held.
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
        let started = Instant::now();
        let mut b = [0u8; 256];
        let cut = loop {
            if slow.write_all(b"x").await.is_err() {
                break true;
            }
            match tokio::time::timeout(Duration::from_secs(1), slow.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(_)) => break true, // an error answer, then the close
                Err(_) if started.elapsed() > Duration::from_secs(30) => break false,
                Err(_) => {}
            }
        };
        assert!(cut, "{name}: a header sent a byte a second was held 30 s");
        // A 390 KB header: refused, never buffered whole.
        let mut big = tokio::net::TcpStream::connect(addr).await.unwrap();
        let header = format!(
            "GET /metrics HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
            "y".repeat(390 * 1024)
        );
        let _ = big.write_all(header.as_bytes()).await;
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), big.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
            "{name}: {answer:.80}"
        );
        // Still answering.
        let base = if name == "agent" {
            agent.http.clone()
        } else {
            collector.clone()
        };
        let metrics = text(&format!("{base}/metrics")).await;
        let refused: f64 = metrics
            .lines()
            .find(|l| !l.starts_with('#') && l.contains("_http_connections_refused_total"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no refusal counter"));
        assert!(
            refused >= 44.0,
            "{name}: {refused} connections refused over the cap"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_whose_storage_is_wiped_is_followed_anew() {
    // NATS restarted on an empty store (a pod rescheduled onto a new volume): the agent
    // makes the stream again and publishes on; the collector finds the stream made anew
    // and follows it with a consumer of its own, counted, and judges what comes.
    let dir = tempfile::tempdir().unwrap();
    let bus_dir = dir.path().join("bus");
    std::fs::create_dir_all(&bus_dir).unwrap();
    let nats = NatsServer::start_anywhere(&bus_dir).unwrap();
    let url = nats.url();
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let log = dir.path().join("router.log");
    append(&log, "");
    let agent = start_agent_on(
        dir.path(),
        &url,
        &[
            "--router-log",
            log.to_str().unwrap(),
            "--heartbeat-secs",
            "1",
        ],
    );
    let (_collector, collector) = start_collector(dir.path(), &url).await;
    append(&log, &decision_lines("before-1"));
    append(&log, &decision_lines("before-2"));
    summary_until(&collector, "the first decisions judged", |s| {
        s["counters"]["decisions"].as_u64() >= Some(2)
    })
    .await;

    drop(nats);
    std::fs::remove_dir_all(bus_dir.join("nats")).unwrap();
    let _nats = NatsServer::start(&bus_dir, port).unwrap();
    append(&log, &decision_lines("after-1"));
    append(&log, &decision_lines("after-2"));
    let s = summary_until(&collector, "the decisions after the wipe judged", |s| {
        s["counters"]["decisions"].as_u64() >= Some(4)
    })
    .await;
    assert!(
        s["bus"]["stream_resets"].as_u64() >= Some(1),
        "{:#}",
        s["bus"]
    );
    agent.readyz_until(200, &["ready"]).await;
    // Its lease went with the wiped storage: it stopped serving at its fence and takes
    // the lease again in the bucket made anew.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ready = get(&format!("{collector}/readyz")).await.unwrap();
        if ready.status() == 200 {
            break;
        }
        let why = ready.text().await.unwrap();
        assert!(
            std::time::Instant::now() < deadline,
            "the collector is not ready again: {why}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = text(&format!("{collector}/metrics")).await;
    assert!(
        metrics.lines().any(
            |l| l.starts_with("kvscope_collector_bus_stream_resets_total ") && !l.ends_with(" 0")
        ),
        "the reset is counted on /metrics"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_host_whose_clock_runs_ahead_is_named_and_moves_no_one_else() {
    // Two agents on one bus, one on a host whose clock reads 55 s ahead (its router
    // too: its log lines carry its clock), inside the minute a record may lie ahead
    // before it is quarantined. The collector learns that agent's offset from when the
    // stream stored its records, moves them back, and names it on /metrics; the healthy
    // agent's records are never late, and the watermark stays at the stream's time.
    //
    // Windows are a minute, and the agents start early in one: the whole run then
    // falls inside it, so a healthy record can only be late if the skewed agent's
    // records carried the watermark past the minute (55 s uncorrected always does).
    // Without that, a healthy record read a moment late by its agent on a loaded host
    // and a heartbeat of the other agent on either side of a window's end would make
    // one record late with no skew at all.
    const SKEW_MS: i64 = 55_000;
    const WINDOW_SECS: u64 = 60;
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(dir.path()).expect("nats-server starts");
    let url = nats.url();
    let window = WINDOW_SECS.to_string();
    let (_collector, collector) =
        start_collector_with(dir.path(), &url, &["--window-secs", &window]).await;
    loop {
        let into_window =
            kvscope_kit::clock::now_ns() / kvscope_kit::clock::NS_PER_SEC % WINDOW_SECS;
        if (1..=20).contains(&into_window) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (healthy_log, skewed_log) = (
        dir.path().join("healthy.log"),
        dir.path().join("skewed.log"),
    );
    append(&healthy_log, "");
    append(&skewed_log, "");
    let (healthy_log_arg, skewed_log_arg) =
        (healthy_log.to_str().unwrap(), skewed_log.to_str().unwrap());
    let args = |log| ["--router-log", log, "--heartbeat-secs", "1"];
    let healthy = start_agent_as(dir.path(), &url, "healthy", 0, &args(healthy_log_arg));
    let skewed = start_agent_as(dir.path(), &url, "skewed", SKEW_MS, &args(skewed_log_arg));
    healthy.readyz_until(200, &["ready"]).await;
    skewed.readyz_until(200, &["ready"]).await;
    let n = 40;
    for i in 0..n {
        let now = kvscope_kit::clock::now_ns();
        let ahead = now + SKEW_MS as u64 * 1_000_000;
        append(
            &healthy_log,
            &decision_lines_at(&kvscope_kit::clock::fmt_utc(now), &format!("h-{i}")),
        );
        append(
            &skewed_log,
            &decision_lines_at(&kvscope_kit::clock::fmt_utc(ahead), &format!("s-{i}")),
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let s = summary_until(&collector, "every decision judged", |s| {
        s["counters"]["decisions"].as_u64() >= Some(2 * n)
    })
    .await;
    let c = &s["counters"];
    assert_eq!(
        c["late_records"], 0,
        "no record of the healthy agent late: {c:#}"
    );
    assert_eq!(c["future_records"], 0, "{c:#}");
    assert!(c["records_clock_corrected"].as_u64() > Some(0), "{c:#}");
    let watermark = s["watermark_ns"].as_u64().unwrap();
    assert!(
        watermark <= kvscope_kit::clock::now_ns() + 2_000_000_000,
        "the watermark stays at the stream's time, not the skewed host's"
    );
    let metrics = text(&format!("{collector}/metrics")).await;
    let ahead = |agent: &str| -> f64 {
        let prefix = format!("kvscope_collector_agent_clock_ahead_seconds{{agent=\"{agent}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no clock offset for {agent} on /metrics"))
            .parse()
            .unwrap()
    };
    let (skewed_ahead, healthy_ahead) = (ahead("skewed"), ahead("healthy"));
    eprintln!(
        "clock offsets on /metrics: skewed {skewed_ahead:.3} s, healthy {healthy_ahead:.3} s"
    );
    assert!((50.0..=55.0).contains(&skewed_ahead), "{skewed_ahead}");
    assert!(healthy_ahead < 1.0, "{healthy_ahead}");
}

/// A vLLM batch as its publisher writes it: `[ts, [events], dp_rank]`, one
/// `AllBlocksCleared`.
fn cleared_batch() -> Vec<u8> {
    let v = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.0),
        rmpv::Value::Array(vec![rmpv::Value::Array(vec!["AllBlocksCleared".into()])]),
        rmpv::Value::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_answer_of_a_gigabyte_is_cut_at_the_agent_s_budget() {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let dir = tempfile::tempdir().unwrap();
    let held = kvscope_lab::ports::reserve_ports(2).unwrap();
    let (pub_ep, replay_ep) = (
        format!("tcp://127.0.0.1:{}", held.ports()[0]),
        format!("tcp://127.0.0.1:{}", held.ports()[1]),
    );
    drop(held);
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(&pub_ep).await.unwrap();
    let mut router = zeromq::RouterSocket::new();
    router.bind(&replay_ep).await.unwrap();
    let kv = format!("{pub_ep}@{replay_ep}=7");
    let agent = start_agent(dir.path(), &["--kv", &kv]);
    agent.readyz_until(200, &["ready"]).await;
    let send = |seq: u64| {
        let mut m = zeromq::ZmqMessage::from(bytes::Bytes::new());
        m.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
        m.push_back(bytes::Bytes::from(cleared_batch()));
        m
    };
    // The subscriber joins a moment after it connects: publish until one arrives.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seq = 0;
    while agent.counter("kv_batches").await.unwrap_or(0.0) < 1.0 {
        assert!(Instant::now() < deadline, "no batch reached the agent");
        publisher.send(send(seq)).await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rss_before = agent.rss_mib();
    // A gap of 60: the agent asks the replay socket from the last batch it took (the
    // same payload again says the same engine), then the ones it missed.
    publisher.send(send(seq + 60)).await.unwrap();
    let request = tokio::time::timeout(Duration::from_secs(30), router.recv())
        .await
        .expect("the agent asks for the missed batches")
        .unwrap();
    let identity = request.get(0).unwrap().clone();
    let from = u64::from_be_bytes(request.get(2).unwrap()[..].try_into().unwrap());
    assert_eq!(from, seq - 1);
    let huge = bytes::Bytes::from(vec![0xc1u8; 16 << 20]);
    for s in from..=from + 60 {
        let mut m = zeromq::ZmqMessage::from(identity.clone());
        m.push_back(bytes::Bytes::new());
        m.push_back(bytes::Bytes::new());
        m.push_back(bytes::Bytes::copy_from_slice(&s.to_be_bytes()));
        m.push_back(if s == from {
            bytes::Bytes::from(cleared_batch())
        } else {
            huge.clone()
        });
        // The agent drops the connection at its budget: the rest cannot be sent.
        if tokio::time::timeout(Duration::from_secs(5), router.send(m))
            .await
            .map_or(true, |r| r.is_err())
        {
            break;
        }
    }
    agent.counter_until("kv_replay_cuts", 1.0).await;
    let rss_after = agent.rss_mib();
    eprintln!("agent RSS {rss_before:.1} → {rss_after:.1} MiB beside a 960 MB replay answer");
    assert!(
        rss_after < rss_before + 400.0,
        "the answer was held: {rss_before:.1} → {rss_after:.1} MiB"
    );
    agent.readyz_until(200, &["ready"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megabyte_request_ids_are_kept_short() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("router.log");
    append(&log, "");
    let agent = start_agent(dir.path(), &["--router-log", log.to_str().unwrap()]);
    let url = agent.nats.as_ref().unwrap().url();
    let (collector_proc, collector) = start_collector(dir.path(), &url).await;
    agent.readyz_until(200, &["ready"]).await;
    let collector_pid = collector_proc.0[0].pid();
    let rss = |pid: u32| -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap()
            / 1024.0
    };
    let (agent_before, collector_before) = (agent.rss_mib(), rss(collector_pid));
    for i in 0..50 {
        let id = format!("{i}-{}", "x".repeat(1 << 20));
        append(&log, &decision_lines(&id));
    }
    agent.counter_until("decisions_joined", 50.0).await;
    assert_eq!(agent.counter("request_ids_shortened").await, Some(50.0));
    summary_until(&collector, "the 50 decisions judged", |s| {
        s["counters"]["decisions"].as_u64() >= Some(50)
    })
    .await;
    let (agent_after, collector_after) = (agent.rss_mib(), rss(collector_pid));
    eprintln!(
        "RSS beside 50 decisions of 1 MB ids: agent {agent_before:.1} → {agent_after:.1} MiB, \
         collector {collector_before:.1} → {collector_after:.1} MiB"
    );
    assert!(agent_after < agent_before + 64.0);
    assert!(collector_after < collector_before + 64.0);
}
