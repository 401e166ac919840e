//! A broken or hostile ZMQ peer must neither kill nor bloat the agent: the real
//! `kvscope-agent` binary taps three publishers — one whose frame header claims 1 TiB,
//! one that claims 8 GiB and then tries to send 2 GiB, and a well-behaved pyzmq PUB — with
//! a real `nats-server -js` as its bus.
//!
//! Asserts: the agent stays up; its resident memory stays within 100 MB of where it
//! started (it used to abort on the 1 TiB claim and grow by 2 GB on the 8 GiB one);
//! each hostile peer is dropped, counted (`kvscope_agent_kv_peer_violations_total`) and
//! reconnected to again; the 8 GiB peer gets nowhere near sending its 2 GiB; and every
//! batch of the good publisher arrives, in order, while the hostile ones keep trying.

use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_wire::recording::read_recording;
use kvscope_wire::vllm_events::{encode_payload, frames};
use kvscope_wire::KvEvent;
use kvscope_wire::Record;
use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::support;
use support::{metric, python, spawn_agent};

/// A ZMTP 3 PUB handshake from the server side, then the subscription the SUB sends.
fn handshake(s: &mut TcpStream) -> std::io::Result<()> {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = 1;
    s.write_all(&g)?;
    let mut peer = [0u8; 64];
    s.read_exact(&mut peer)?;
    let mut ready = vec![5u8];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"PUB");
    s.write_all(&[0x04, ready.len() as u8])?;
    s.write_all(&ready)?;
    // The client's READY command, then its subscription message.
    for _ in 0..2 {
        let mut head = [0u8; 2];
        s.read_exact(&mut head)?;
        let mut body = vec![0u8; usize::from(head[1])];
        s.read_exact(&mut body)?;
    }
    Ok(())
}

/// A publisher that, on every connection, completes the handshake, sends a frame header
/// claiming `claim` bytes, then streams up to `send` bytes of it. Counts connections and
/// bytes it managed to write.
struct Hostile {
    port: u16,
    connections: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Hostile {
    fn start(claim: u64, send: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (connections, written, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (c, w, st) = (connections.clone(), written.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let Ok((mut s, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                s.set_nonblocking(false).unwrap();
                if handshake(&mut s).is_err() {
                    continue;
                }
                c.fetch_add(1, Ordering::Relaxed);
                let mut head = vec![0x02u8];
                head.extend_from_slice(&claim.to_be_bytes());
                if s.write_all(&head).is_err() {
                    continue;
                }
                let chunk = vec![0x5au8; 1 << 20];
                let mut sent = 0;
                while sent < send && !st.load(Ordering::Relaxed) {
                    match s.write(&chunk) {
                        Ok(n) => {
                            sent += n as u64;
                            w.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Err(_) => break,
                    }
                }
                // Keep the connection open until the agent drops it.
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.read(&mut [0u8; 1]);
            }
        });
        Self {
            port,
            connections,
            written,
            stop,
        }
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// One `AllBlocksCleared` batch from a vLLM publisher, with an empty topic.
fn batch(seq: u64) -> Vec<Vec<u8>> {
    let payload = encode_payload(
        kvscope_kit::clock::now_ns() as f64 / 1e9,
        &[KvEvent::AllBlocksCleared],
        0,
    );
    frames(b"", seq, payload).to_vec()
}

#[test]
fn hostile_frame_claims_neither_kill_nor_bloat_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(dir.path()).expect("nats-server -js (scripts/setup)");
    let tib = Hostile::start(1 << 40, 0);
    let gib8 = Hostile::start(8 << 30, 2 << 30);

    // The good publisher: 40 batches, 50 ms apart, once the agent subscribes.
    const GOOD: u64 = 40;
    let good_port = kvscope_lab::ports::pick_ports(1).unwrap()[0];
    let good_endpoint = format!("tcp://127.0.0.1:{good_port}");
    let hex = |f: &[u8]| f.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let spec = serde_json::json!({
        "interval_secs": 0.05,
        "messages": (0..GOOD).map(|s| serde_json::json!({
            "frames_hex": batch(s).iter().map(|f| hex(f)).collect::<Vec<_>>()
        })).collect::<Vec<_>>()
    });
    let spec_path = dir.path().join("good.json");
    std::fs::write(&spec_path, serde_json::to_vec(&spec).unwrap()).unwrap();
    let mut cmd = Command::new(python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/e2e/agent/support/kv_publisher.py"
    ))
    .arg(&good_endpoint)
    .arg(&spec_path)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    let mut good = StopOnDrop(vec![ManagedProcess::spawn_with_stdio(
        "good-publisher",
        cmd,
    )
    .expect("the lab venv's python")]);
    let mut good_out = std::io::BufReader::new(good[0].child.stdout.take().unwrap());
    let mut line = String::new();
    good_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "bound");

    let metrics_port = kvscope_lab::ports::pick_ports(1).unwrap()[0];
    let metrics = format!("127.0.0.1:{metrics_port}");
    let recording = dir.path().join("agent.jsonl");
    let mut agent = spawn_agent(
        dir.path(),
        &nats.url(),
        "hostile",
        &metrics,
        &[
            format!("tcp://127.0.0.1:{}=1", tib.port),
            format!("tcp://127.0.0.1:{}=2", gib8.port),
            format!("{good_endpoint}=3"),
        ],
        &recording,
    );
    let pid = agent[0].pid();

    // Wait for /metrics, then take the baseline.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&metrics, "kvscope_agent_kv_batches_total").is_none() {
        assert!(Instant::now() < deadline, "the agent never served /metrics");
        std::thread::sleep(Duration::from_millis(50));
    }
    let baseline = rss_bytes(pid);
    let mut peak = baseline;
    // Until both hostile peers were refused at least three times each and the good
    // publisher is done.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut good_done = false;
    loop {
        assert!(agent[0].exited().is_none(), "the agent died");
        peak = peak.max(rss_bytes(pid));
        if !good_done {
            good_out.read_line(&mut line).unwrap();
            good_done = line.contains("sent");
        }
        let violations = metric(&metrics, "kvscope_agent_kv_peer_violations_total").unwrap_or(0);
        if good_done
            && violations >= 6
            && tib.connections.load(Ordering::Relaxed) >= 3
            && gib8.connections.load(Ordering::Relaxed) >= 3
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "violations {violations}, connections {} / {}, good done {good_done}",
            tib.connections.load(Ordering::Relaxed),
            gib8.connections.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        peak < baseline + 100 * 1024 * 1024,
        "RSS went from {baseline} to {peak} bytes"
    );
    let written = gib8.written.load(Ordering::Relaxed);
    assert!(
        written < 256 << 20,
        "the 8 GiB peer sent {written} bytes before being dropped"
    );

    // Stop the agent; its recording has every good batch, in order.
    agent.stop(Duration::from_secs(5));
    drop(good_out);
    good.stop(Duration::from_secs(1));
    let rec = read_recording(&recording).unwrap();
    let seqs: Vec<u64> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b) if b.worker.worker_id == 3 => Some(b.seq),
            _ => None,
        })
        .collect();
    assert_eq!(seqs, (0..GOOD).collect::<Vec<_>>());
    assert!(
        rec.envelopes.iter().all(|e| match &e.record {
            Record::KvEvents(b) => b.worker.worker_id == 3,
            _ => true,
        }),
        "nothing was taken from the hostile peers"
    );
    drop(nats);
}
