//! One long prompt must not silence a node: 131,072- and 1,048,576-token prefills on the
//! real lab (Dynamo 1.6.1's KV router, 2 mockers with room for them), through `kvscope
//! agent` → NATS JetStream (its default 1 MiB `max_payload`) → `kvscope collector`.
//!
//! A 1M-token prefill's KV batch from an engine that publishes a prefill as one
//! `BlockStored` is larger than one NATS message (vLLM does; the mocker splits it, so a
//! pyzmq publisher beside the lab sends two such batches, 131,072 and 1,048,576 tokens,
//! as a third worker), and a decision of a few million tokens would be too (its hashes
//! packed, ~0.7 MB per million tokens): the agent sends such records in parts and the
//! collector joins them. Asserts: every request is a joined decision, the short ones sent after
//! the long ones included; the collector applied exactly the records the agent
//! observed, in its order (so every part came back together, byte for byte); records
//! were split, none dropped, set aside or left incomplete; the third worker's mirror
//! holds every block of both batches; and every decision's overlaps equal
//! `dynamo-kv-router` 1.6.1's radix tree fed the same events, the repeated long prompts
//! finding their whole prefix.

use kvscope_e2e::oracle;

use kvscope_collector::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::LabConfig;
use kvscope_wire::{AgentCounters, Record};
use std::path::Path;
use std::time::Duration;

const BLOCK: u64 = 16;

/// A prompt of exactly `tokens` tokens with the fixture tokenizer (one per word), its
/// words chosen by `seed`.
fn prompt(seed: u64, tokens: usize) -> String {
    let mut rng = kvscope_lab::workload::SplitMix64::new(seed);
    (0..tokens)
        .map(|_| format!("w{}", rng.below(1900)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The worker id of the vLLM-format publisher beside the lab.
const VLLM_WORKER: u64 = 42;

/// One vLLM batch (positional form, as vLLM before PR #42892 sends it) storing a
/// `tokens`-token chain of fresh blocks in one `BlockStored`; its ZMQ frames.
fn one_block_stored(seq: u64, first_hash: u64, tokens: u64) -> Vec<Vec<u8>> {
    use rmpv::Value;
    let blocks = tokens / BLOCK;
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array((0..blocks).map(|i| Value::from(first_hash + i)).collect()),
        Value::Nil,
        Value::Array(
            (0..tokens)
                .map(|t| Value::from((t * 7 + seq) % 2000))
                .collect(),
        ),
        Value::from(BLOCK),
        Value::Nil,
        Value::from("GPU"),
    ]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(
        &mut payload,
        &Value::Array(vec![
            Value::F64(ts),
            Value::Array(vec![event]),
            Value::from(0),
        ]),
    )
    .unwrap();
    vec![Vec::new(), seq.to_be_bytes().to_vec(), payload]
}

/// A pyzmq PUB (`agent/support/kv_publisher.py` beside this module) that sends `messages`
/// once the agent subscribes, and lingers until dropped.
fn vllm_publisher(
    dir: &Path,
    endpoint: &str,
    messages: &[Vec<Vec<u8>>],
) -> kvscope_lab::process::StopOnDrop {
    let hex = |f: &[u8]| f.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let spec = serde_json::json!({
        "messages": messages.iter().map(|m| serde_json::json!({
            "frames_hex": m.iter().map(|f| hex(f)).collect::<Vec<_>>()
        })).collect::<Vec<_>>()
    });
    let spec_path = dir.join("vllm-spec.json");
    std::fs::write(&spec_path, serde_json::to_vec(&spec).unwrap()).unwrap();
    let python = kvscope_lab::paths::venv_python(&kvscope_lab::paths::default_lab_dir());
    let mut cmd = std::process::Command::new(python);
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/e2e/agent/support/kv_publisher.py"
    ))
    .arg(endpoint)
    .arg(&spec_path)
    .stdin(std::process::Stdio::piped());
    kvscope_lab::process::StopOnDrop(vec![kvscope_lab::process::ManagedProcess::spawn(
        "vllm-publisher",
        cmd,
        &dir.join("vllm-publisher.log"),
    )
    .expect("the lab venv's python with pyzmq")])
}

async fn complete(client: &reqwest::Client, frontend: &str, prompt: &str) -> u64 {
    let r: serde_json::Value = client
        .post(format!("{frontend}/v1/completions"))
        .json(&serde_json::json!({
            "model": "kvscope-tiny",
            "prompt": prompt,
            "max_tokens": 2,
        }))
        .timeout(Duration::from_secs(300))
        .send()
        .await
        .expect("the frontend answers")
        .error_for_status()
        .expect("the request succeeds")
        .json()
        .await
        .unwrap();
    r["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_token_prefills_are_judged_exactly_and_hold_nothing_back() {
    let dir = tempfile::tempdir().unwrap();
    // The fixture model's context (4M tokens) holds a 1M-token prompt.
    let lab = LabConfig {
        workers: 2,
        // Room for two 1M-token prompts per worker, and a fast simulated prefill.
        num_gpu_blocks: 140_000,
        speedup_ratio: 1000.0,
        ..LabConfig::default()
    };
    // Held until the publisher binds it (libzmq sets SO_REUSEADDR): a port only picked
    // could be chosen by the lab starting in between.
    let vllm_port_held = kvscope_lab::ports::reserve_ports(1).unwrap();
    let vllm_endpoint = format!("tcp://127.0.0.1:{}", vllm_port_held.ports()[0]);
    let vllm_batches = [
        one_block_stored(0, 1 << 40, 131_072),
        one_block_stored(1, 2 << 40, 1_048_576),
    ];
    let _vllm = vllm_publisher(dir.path(), &vllm_endpoint, &vllm_batches);
    let tap = format!("{vllm_endpoint}={VLLM_WORKER}");
    let run = kvscope_e2e::fleet_with(FleetRunConfig::new(lab, 4.0), |_| {
        Ok(vec!["--kv".into(), tap])
    })
    .await
    .expect("lab, agent and collector start");
    let frontend = run.lab().frontend_url().to_string();
    let client = reqwest::Client::new();

    // Each long prompt twice (the second finds it cached), then short ones: they must
    // not wait behind the long records.
    let mut sent = Vec::new();
    for (seed, tokens) in [(1, 131_072), (2, 1_048_576)] {
        let p = prompt(seed, tokens);
        for _ in 0..2 {
            sent.push(complete(&client, &frontend, &p).await);
        }
    }
    for seed in 10..15 {
        sent.push(complete(&client, &frontend, &prompt(seed, 300)).await);
    }
    assert_eq!(&sent[..4], &[131_072, 131_072, 1_048_576, 1_048_576]);
    // Every decision and batch reached the collector before the agent stops.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let summary = run.summary().await.expect("the collector's summary");
        let pairs = summary["cached_block_pairs"].as_u64().unwrap_or(0);
        if summary["counters"]["decisions"].as_u64() == Some(sent.len() as u64)
            && pairs >= (131_072 + 1_048_576) / BLOCK
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "decisions at the collector: {}",
            summary["counters"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let agent_recording = run.agent_recording.clone();
    let recording = run.finish().await.expect("the collector catches up");

    // Joined from their parts, in the agent's order.
    let rec = kvscope_e2e::applied_as_published(&agent_recording, &recording);
    let counters: AgentCounters =
        kvscope_e2e::last_agent_counters(&rec.envelopes).expect("a heartbeat");
    // Every record over the server's 1 MiB `max_payload` went in parts: at least the
    // 1M-token one-store batch (its block and local hashes are ~1.4 MB packed).
    let over_a_message = rec
        .envelopes
        .iter()
        .filter(|e| e.to_json().len() > 1024 * 1024)
        .count();
    assert!(
        over_a_message >= 1 && counters.records_split >= over_a_message as u64,
        "{over_a_message} records over 1 MiB, {} went in parts: {counters:?}",
        counters.records_split
    );
    assert_eq!(
        (counters.publish_dropped, counters.records_set_aside),
        (0, 0),
        "{counters:?}"
    );

    let mut analyzer = FleetAnalyzer::new(AnalyzerConfig {
        window_secs: 4.0,
        warmup_secs: 4.0,
        ..AnalyzerConfig::default()
    });
    let verdicts: Vec<_> = rec
        .envelopes
        .iter()
        .filter_map(|e| analyzer.apply(e))
        .collect();
    assert_eq!(analyzer.counters().incomplete_records, 0);
    let vllm = kvscope_wire::WorkerKey {
        worker_id: VLLM_WORKER,
        dp_rank: 0,
    };
    assert_eq!(
        analyzer.index().cached_blocks(&vllm),
        ((131_072 + 1_048_576) / BLOCK) as usize,
        "every block of both one-store batches is in the mirror"
    );
    assert_eq!(
        verdicts.len(),
        sent.len(),
        "every request is a joined decision"
    );
    // Completions requests: the router's routing lines name no model (they are logged
    // outside the request's span); the agent takes it from each request's arrival line.
    let models: Vec<Option<String>> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::Decision(d) => Some(d.model.clone()),
            _ => None,
        })
        .collect();
    assert!(
        models.len() == sent.len() && models.iter().all(|m| m.as_deref() == Some("kvscope-tiny")),
        "every completions decision names its model: {models:?}"
    );
    let isl: Vec<u64> = verdicts.iter().map(|v| v.isl_tokens).collect();
    assert_eq!(isl, sent, "decisions in the order the requests were sent");
    oracle::assert_overlaps_equal(&verdicts, &rec.envelopes);
    // The repeated long prompts found their whole prefix on the worker holding it.
    for (i, tokens) in [(1, 131_072u64), (3, 1_048_576)] {
        let best = verdicts[i].overlaps.values().max().copied().unwrap_or(0);
        assert_eq!(
            u64::from(best),
            tokens / BLOCK,
            "request {i}: {:?}",
            verdicts[i].overlaps
        );
    }
}
