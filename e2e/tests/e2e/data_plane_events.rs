//! The NIXL lab's data plane publishes what lands on it as vLLM KV events, and kvscope
//! sees the blocks appear on the target: two engines publish real ZMQ KV events (engine
//! 0 holds a 4-block prompt, engine 1 its first block); `kvscope-nixl-lab serve` follows
//! them; `kvscope agent` taps the engines and the data plane's publishers (each under its
//! engine's worker id) into `nats-server -js` and `kvscope collector`. A directive moves
//! blocks 2–4 from engine 0 to engine 1 over real NIXL, and the collector's mirror then
//! holds them on worker 101 — blocks its engine never computed. Needs the NIXL wheel
//! (`scripts/setup`); no root (no eBPF here).

use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{log_tail, ManagedProcess, StopOnDrop};
use kvscope_nixl_lab::serve::process::ServeProcess;
use kvscope_nixl_lab::serve::{ServeStatus, ServeWorker};
use kvscope_wire::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::vllm_events::{encode_payload, frames};
use kvscope_wire::{sequence_hashes, KvEvent, WorkerKey};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketSend};

const CLUSTER: &str = "dataplane";
const TOKEN: &str = "data-plane-test-token-0123456789";
const BS: usize = 16;

fn stored(hashes: &[u64], tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: BS as u32,
        local_hashes: None,
        lora_name: None,
        medium: None,
        cache_salt: None,
    }
}

async fn summary(addr: &str) -> Value {
    match reqwest::get(format!("http://{addr}/api/summary")).await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrated_blocks_appear_on_the_target_in_the_collector() {
    let exe = kvscope_e2e::kvscope();
    kvscope_nixl_lab::NixlLibs::ensure(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("the NIXL wheel is not set up: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(dir.path()).expect("nats-server starts");

    // The engines.
    let mut engines = Vec::new();
    let mut endpoints = Vec::new();
    for _ in 0..2 {
        let mut pubs = zeromq::PubSocket::new();
        endpoints.push(pubs.bind("tcp://127.0.0.1:0").await.unwrap().to_string());
        engines.push(pubs);
    }
    let tokens: Vec<u32> = (0..(4 * BS) as u32).map(|t| 9000 + t * 7).collect();
    let chain = sequence_hashes(&local_block_hashes(&tokens, BS, DYNAMO_HASH_SEED));
    let worker = |id| WorkerKey {
        worker_id: id,
        dp_rank: 0,
    };

    // The data plane.
    let workers: Vec<ServeWorker> = (0..2)
        .map(|i| ServeWorker {
            name: format!("decode-{i}"),
            worker: worker(100 + i as u64),
            engine: Some(endpoints[i].clone()),
            kv_bind: "tcp://127.0.0.1:0".into(),
            sidecar: None,
        })
        .collect();
    let serve = ServeProcess::start(
        &kvscope_nixl_lab::lab_binary(),
        &workers,
        TOKEN,
        &dir.path().join("serve.log"),
        &[],
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));

    // kvscope: collector, and an agent tapping both engines and both data-plane workers.
    // Held until the collector answers, so nothing started meanwhile takes the port.
    let collector_port = kvscope_lab::ports::reserve_ports(1).unwrap();
    let collector_addr = format!("127.0.0.1:{}", collector_port.ports()[0]);
    let mut procs = StopOnDrop::default();
    let mut collector = Command::new(&exe);
    collector
        .args(["collector", "run", "--nats-url", &nats.url()])
        .args(["--cluster", CLUSTER, "--listen", &collector_addr]);
    let collector_log = dir.path().join("collector.log");
    procs.push(ManagedProcess::spawn("collector", collector, &collector_log).unwrap());
    let mut agent = Command::new(&exe);
    agent
        .args(["agent", "--nats-url", &nats.url(), "--cluster", CLUSTER])
        .args(["--agent-id", "dp-node"])
        .env("RUST_LOG", "info");
    for (i, ep) in endpoints.iter().enumerate() {
        agent.arg("--kv").arg(format!("{ep}={}", 100 + i));
    }
    for w in &serve.ready.workers {
        agent
            .arg("--kv")
            .arg(format!("{}={}", w.kv_endpoint, w.worker.worker_id));
    }
    let agent_log = dir.path().join("agent.log");
    procs.push(ManagedProcess::spawn("agent", agent, &agent_log).unwrap());

    // The engines publish until both the data plane's books and the collector's mirror
    // hold their blocks (ZMQ drops what is sent before a subscriber joins; a repeated
    // store is a restore, harmless).
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seq = 0;
    loop {
        for (i, (pubs, ev)) in engines
            .iter_mut()
            .zip([
                stored(&[0xa0, 0xa1, 0xa2, 0xa3], &tokens),
                stored(&[0xb0], &tokens[..BS]),
            ])
            .enumerate()
        {
            let f = frames(b"", seq, encode_payload(1.7e9 + i as f64, &[ev], 0));
            let msg: Vec<bytes::Bytes> = f.into_iter().map(bytes::Bytes::from).collect();
            pubs.send(zeromq::ZmqMessage::try_from(msg).unwrap())
                .await
                .unwrap();
        }
        seq += 1;
        let st: ServeStatus = http
            .get(format!("{}/v1/status", serve.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let s = summary(&collector_addr).await;
        let books = (st.workers[0].book_blocks, st.workers[1].book_blocks);
        if books == (4, 1) && s["cached_block_pairs"] == 5 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "books {books:?}, collector {}; its log ends:\n{}",
            s["cached_block_pairs"],
            log_tail(&collector_log, 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The agent's tap on the target's publisher must be up before anything is published
    // there (a ZMQ PUB drops messages nobody subscribed to yet).
    let target_ep = &serve.ready.workers[1].kv_endpoint;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&agent_log)
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains("KV event tap connected") && l.contains(target_ep.as_str()))
    {
        assert!(
            Instant::now() < deadline,
            "the agent never tapped {target_ep}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let d = kvscope_e2e::data_plane::directive("kvm-dp-1", &chain[1..], Some(chain[0]), BS as u32);
    let (code, body) = kvscope_e2e::data_plane::post(&http, &serve.url(), &d, Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");

    // The blocks appear on worker 101 in the collector's mirror: 4 + 4 pairs.
    let deadline = Instant::now() + Duration::from_secs(30);
    let s = loop {
        let s = summary(&collector_addr).await;
        if s["cached_block_pairs"] == 8 {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the collector never showed the migrated blocks on the target: {}; its log \
             ends:\n{}",
            s["cached_block_pairs"],
            log_tail(&collector_log, 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let c = &s["counters"];
    assert_eq!(c["unknown_parent_events"], 0, "{c}");
    assert_eq!(c["token_count_mismatches"], 0, "{c}");
    assert_eq!(c["sequence_gaps"], 0, "{c}");
    assert_eq!(
        s["workers"], 2,
        "the data plane publishes under the engines' ids"
    );
    drop(serve);
    procs.stop(Duration::from_secs(5));
}
