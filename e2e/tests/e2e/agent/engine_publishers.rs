//! The engines' own KV event publishers — `ZmqEventPublisher` and its event classes from
//! the vLLM 0.23.0 (positional events), 0.33.0 and 0.34.0 (map events) wheels and from
//! the SGLang 0.5.23 wheel, run unmodified (`support/engine_publisher.py`; scripts/setup
//! extracts the modules) — against the real `kvscope-agent` binary with a real
//! `nats-server -js` as its bus. A relay between them drops the batches a test says (the
//! publisher's ROUTER, the agent's replay source, is the publisher's own). Which
//! releases: `KVSCOPE_ENGINE_MATRIX` (`scripts/engine-matrix` sets every published one).
//!
//! Asserts, on every version:
//! - every event and field the publisher writes decoded exactly (unsigned, signed and
//!   bytes hashes, parents, media, LoRA names, data-parallel ranks), and each field the
//!   agent does not carry counted by name
//!   (`kvscope_agent_kv_fields_left_out_<field>_total`);
//! - the events a router does not take refused and counted by why
//!   (`kvscope_agent_kv_events_refused_<why>_total`: a hybrid model's sliding-window
//!   group, as its store names it and as its removal's group was learned; remote
//!   blocks; another owner's), and a salted chain's continuation salted as its first
//!   block where the engine has `extra_keys`;
//! - a gap replayed; a replay past the agent's 16,384 batches per answer (the
//!   publisher's `buffer_steps` set higher) taken in more than one answer; an engine restart first
//!   seen through the replay socket marked a reset; an engine restart whose numbers ran
//!   past the old engine's last batch, or just as far behind a dropped connection,
//!   told by the replayed payload and replayed from 0; a dropped connection to the same
//!   engine checked and not counted as a recovery:
//!   every batch of every engine delivered exactly once, in order, each engine's first
//!   marked as the start it is, none counted lost and none counted recovered wrongly.

use kvscope_lab::nats::NatsServer;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use kvscope_wire::recording::read_recording;
use kvscope_wire::vllm_events::{FieldsLeftOut, CARRIED, META_FIELDS};
use kvscope_wire::{KvEvent, Record, SequenceStatus};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use super::support;
use support::{metric, python, spawn_agent};

const WORKER: u64 = 7;
/// Batches the large replay misses: more than one answer of the agent's holds.
const LARGE_GAP: u64 = 17_000;

/// The publisher driver: one command in, one JSON answer out.
struct Driver {
    /// Held to stop the driver when the test ends, passing or not.
    _child: StopOnDrop,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Driver {
    fn ask(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        let answer: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the driver answered {line:?} to {cmd}: {e}"));
        assert!(answer.get("error").is_none(), "{cmd}: {answer}");
        answer
    }

    /// Start a publisher (an engine): returns how many probe batches it numbered.
    fn start(&mut self) -> u64 {
        self.ask(json!({"cmd": "start", "buffer_steps": 20_000}))["probes"]
            .as_u64()
            .unwrap()
    }

    fn publish(&mut self, batches: Value) -> Vec<u64> {
        let a = self.ask(json!({"cmd": "publish", "batches": batches}));
        a["seqs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_u64().unwrap())
            .collect()
    }

    /// `n` one-block batches; returns the last number.
    fn publish_many(&mut self, n: u64, first_hash: u64) -> u64 {
        let a = self.ask(json!({"cmd": "publish_many", "n": n, "first_hash": first_hash}));
        a["last"].as_u64().unwrap()
    }
}

/// Wait until the agent has taken `n` batches in all.
fn wait_batches(metrics: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = metric(metrics, "kvscope_agent_kv_batches_total").unwrap_or(0);
        if got >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the agent took {got} of {n} batches"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn hash_hex(b: &[u8]) -> Value {
    json!({"bytes": b.iter().map(|x| format!("{x:02x}")).collect::<String>()})
}

/// Values for the fields an engine's events may carry beyond those the agent carries:
/// the ones that say which events a router takes ([`META_FIELDS`]) set to what it
/// takes (the full-attention group, local blocks); [`refusals`] sets the others.
fn extras() -> Vec<(&'static str, Value)> {
    vec![
        ("lora_id", json!(3)),
        ("extra_keys", json!([["salt-1"], null, null])),
        ("group_idx", json!(0)),
        ("kv_cache_spec_kind", json!("full_attention")),
        ("kv_cache_spec_sliding_window", json!(128)),
        ("locality", json!("LOCAL")),
        ("session_id", json!("session-9")),
        ("lookahead_token_ids", json!([[9, 10]])),
    ]
}

/// The batches that exercise every field this engine's classes have, the events the
/// agent must make of them (tokens become their blocks' local hashes on the agent, as
/// every batch's do), and how many events set each field the agent does not carry.
#[allow(clippy::type_complexity)]
fn every_field(
    fields: &Value,
) -> (
    Value,
    Vec<Vec<KvEvent>>,
    FieldsLeftOut,
    Vec<(&'static str, u64)>,
) {
    let has = |class: &str, f: &str| {
        fields[class]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x.as_str() == Some(f))
    };
    let mut left_out = FieldsLeftOut::default();
    let mut count = |f: &str| *left_out.field_mut(f) += 1;
    // Media and LoRA names where the engine has them (vLLM from 0.11 and 0.14).
    let medium = |m: &str| has("BlockStored", "medium").then(|| m.to_string());
    let lora_name = has("BlockStored", "lora_name").then(|| "adapter-a".to_string());
    // SGLang's tenant namespace: carried, and part of the blocks' identity (their local
    // hashes are seeded with it, as Dynamo's router seeds them).
    let cache_salt = has("BlockStored", "cache_salt").then(|| "salt-a".to_string());
    let mut stored = json!({
        "type": "BlockStored",
        // Unsigned past 2^63, and signed (SGLang's namespaced hashes are int64).
        "block_hashes": [11u64, u64::MAX - 3, -5],
        "parent_block_hash": 10,
        "token_ids": (1..=12).collect::<Vec<u32>>(),
        "block_size": 4,
    });
    let mut removed = json!({"type": "BlockRemoved", "block_hashes": [11u64]});
    let mut removed_unset = json!({"type": "BlockRemoved", "block_hashes": [12u64]});
    if let Some(m) = medium("GPU") {
        stored["medium"] = json!(m);
        removed["medium"] = json!(m);
        removed_unset["medium"] = Value::Null;
    }
    if let Some(l) = &lora_name {
        stored["lora_name"] = json!(l);
    }
    if let Some(c) = &cache_salt {
        stored["cache_salt"] = json!(c);
    }
    for (f, v) in extras() {
        let read_past = !META_FIELDS.contains(&f);
        if has("BlockStored", f) {
            stored[f] = v.clone();
            if read_past {
                count(f);
            }
        }
        if has("BlockRemoved", f) && f != "lora_id" {
            removed[f] = v;
            if read_past {
                count(f);
            }
        }
    }
    let mut s1 = KvEvent::BlockStored {
        block_hashes: vec![11, u64::MAX - 3, -5i64 as u64],
        parent_block_hash: Some(10),
        token_ids: (1..=12).collect(),
        block_size: 4,
        local_hashes: None,
        lora_name,
        medium: medium("GPU"),
        cache_salt,
    };
    s1.hash_tokens();
    let mut first = vec![stored];
    let mut first_want = vec![s1];
    if fields["engine"] == "vllm" {
        // A 32-byte hash (vLLM's sha256 block hashes) and a parent of bytes.
        let long: Vec<u8> = (0..32u8).collect();
        first.push(json!({
            "type": "BlockStored",
            "block_hashes": [hash_hex(&long)],
            "parent_block_hash": hash_hex(&[0xab, 0xcd]),
            "token_ids": [5, 6, 7, 8],
            "block_size": 4,
        }));
        if let Some(m) = medium("CPU") {
            first.last_mut().unwrap()["medium"] = json!(m);
        }
        let mut s2 = KvEvent::BlockStored {
            block_hashes: vec![u64::from_be_bytes(long[24..].try_into().unwrap())],
            parent_block_hash: Some(0xabcd),
            token_ids: vec![5, 6, 7, 8],
            block_size: 4,
            local_hashes: None,
            lora_name: None,
            medium: medium("CPU"),
            cache_salt: None,
        };
        s2.hash_tokens();
        first_want.push(s2);
    }
    // What a router does not take: a hybrid model's sliding-window group (its store
    // names its kind; its removal only its group), remote blocks, another owner's.
    // And a salted chain (Dynamo's tag in the first block's extra_keys): its
    // continuation names no salt and takes the first block's.
    let mut refused = Vec::new();
    let mut taken = Vec::new();
    let mut refusals = Vec::new();
    let store = |hash: u64, parent: Option<u64>| {
        json!({"type": "BlockStored", "block_hashes": [hash], "parent_block_hash": parent,
               "token_ids": [1, 2, 3, 4], "block_size": 4})
    };
    if has("BlockStored", "group_idx") && has("BlockStored", "kv_cache_spec_kind") {
        let mut e = store(21, None);
        e["group_idx"] = json!(1);
        e["kv_cache_spec_kind"] = json!("sliding_window");
        refused.push(e);
        let mut n = 1;
        if has("BlockRemoved", "group_idx") {
            refused.push(json!({"type": "BlockRemoved", "block_hashes": [21], "group_idx": 1}));
            n += 1;
        }
        refusals.push(("other_cache_group", n));
    }
    for (f, v, counter) in [
        ("locality", "REMOTE", "not_local"),
        ("ownership", "kvcr", "other_owner"),
    ] {
        if has("BlockStored", f) {
            let mut e = store(22, None);
            e[f] = json!(v);
            refused.push(e);
            refusals.push((counter, 1));
        }
    }
    if has("BlockStored", "extra_keys") {
        let mut e = store(31, None);
        e["extra_keys"] = json!([["dynamo-cache-salt:tenant-x"]]);
        count("extra_keys");
        refused.push(e);
        refused.push(store(32, Some(31)));
        for (hash, parent) in [(31, None), (32, Some(31))] {
            let mut want = KvEvent::BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                local_hashes: None,
                lora_name: None,
                medium: None,
                cache_salt: Some("tenant-x".into()),
            };
            want.hash_tokens();
            taken.push(want);
        }
        refusals.push(("salts_inherited", 1));
        // A block holding an image: the routing hash Dynamo's frontend marked, as
        // `[hash, offset]` (vLLM 0.19 on) beside vLLM's own hash of it (no object); the
        // agent here is given its worker, so the model's placeholders are not known and
        // the object is hashed after the tokens (and counted so).
        let object = 0x0123_4567_89ab_cdefu64;
        let mut e = store(41, None);
        e["token_ids"] = json!([1, 99, 99, 4]);
        e["extra_keys"] = json!([[
            format!("{:064x}", u128::MAX),
            [format!("{object:016x}{}", "0".repeat(48)), 1]
        ]]);
        count("extra_keys");
        refused.push(e);
        let mut want = KvEvent::BlockStored {
            block_hashes: vec![41],
            parent_block_hash: None,
            token_ids: vec![1, 99, 99, 4],
            block_size: 4,
            local_hashes: None,
            lora_name: None,
            medium: None,
            cache_salt: None,
        };
        want.hash_tokens_with_media(&[(0, vec![object])], Default::default());
        taken.push(want);
        refusals.push(("media_blocks_without_placeholders", 1));
    }
    let batches = json!([
        {"events": first},
        {"events": [removed, removed_unset], "data_parallel_rank": 1},
        {"events": [{"type": "AllBlocksCleared"}]},
        {"events": refused},
    ]);
    let want = vec![
        first_want,
        vec![
            KvEvent::BlockRemoved {
                block_hashes: vec![11],
                medium: medium("GPU"),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![12],
                medium: None,
            },
        ],
        vec![KvEvent::AllBlocksCleared],
        taken,
    ];
    (batches, want, left_out, refusals)
}

/// What one version's events are: positional or maps, and the fields its classes have
/// that the agent reads past (counted, not carried).
struct Shape {
    positional: bool,
    not_carried: Vec<String>,
}

fn run_version(engine: &str, version: &str) -> Shape {
    let version_dir = kvscope_lab::paths::default_lab_dir()
        .join(engine)
        .join(version);
    let module = match engine {
        "vllm" => "vllm/distributed/kv_events.py",
        _ => "sglang/srt/disaggregation/kv_events.py",
    };
    assert!(
        version_dir.join(module).is_file(),
        "{engine} {version}'s publisher is not under {}: run scripts/setup",
        version_dir.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_anywhere(dir.path()).expect("nats-server -js (scripts/setup)");
    let [relay_port, replay_port, metrics_port] = kvscope_lab::ports::pick_ports(3)
        .unwrap()
        .try_into()
        .unwrap();
    let relay = format!("tcp://127.0.0.1:{relay_port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let mut cmd = Command::new(python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/e2e/agent/support/engine_publisher.py"
    ))
    .arg(&version_dir)
    .arg(&relay)
    .arg(&replay)
    .arg(dir.path().join("publisher.sock"))
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    let mut child = ManagedProcess::spawn_with_stdio("vllm-publisher", cmd)
        .expect("the lab venv's python (pyzmq, msgspec)");
    let stdin = child.child.stdin.take().unwrap();
    let out = BufReader::new(child.child.stdout.take().unwrap());
    let mut driver = Driver {
        _child: StopOnDrop(vec![child]),
        stdin,
        out,
    };
    let fields = driver.ask(json!({"cmd": "fields"}));
    assert_eq!(fields["engine"], engine);
    let mut not_carried: Vec<String> = ["BlockStored", "BlockRemoved"]
        .iter()
        .flat_map(|c| fields[c].as_array().unwrap())
        .filter_map(|f| f.as_str())
        .filter(|f| !CARRIED.contains(f) && !META_FIELDS.contains(f))
        .map(str::to_string)
        .collect();
    not_carried.dedup();
    not_carried.sort();
    not_carried.dedup();
    let shape = Shape {
        positional: fields["positional"].as_bool().unwrap(),
        not_carried,
    };

    let metrics = format!("127.0.0.1:{metrics_port}");
    let recording = dir.path().join("agent.jsonl");
    let mut agent = spawn_agent(
        dir.path(),
        &nats.url(),
        "vllm",
        &metrics,
        &[format!("{relay}@{replay}={WORKER}")],
        &recording,
    );

    // Engine 1: its probes (taken late, through the replay socket), every field, a gap
    // of two batches, and a gap of more than one answer can hold.
    let mut engines: Vec<u64> = Vec::new(); // batches each engine numbered
    let mut taken = 0;
    let mut n = driver.start();
    // Until the agent's subscription is in place, the relay's PUB drops what it sends.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&metrics, "kvscope_agent_kv_batches_total").unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "the agent took no batch");
        n += driver.publish(json!([{"events": []}])).len() as u64;
        std::thread::sleep(Duration::from_millis(100));
    }
    let (batches, want_events, want_left_out, want_refusals) = every_field(&fields);
    let field_seqs = driver.publish(batches);
    n += field_seqs.len() as u64;
    taken += n;
    wait_batches(&metrics, taken);
    driver.ask(json!({"cmd": "drop", "range": [n + 1, n + 3]}));
    n = *driver
        .publish(json!([{"events": []}, {"events": []}, {"events": []}, {"events": []}]))
        .last()
        .unwrap()
        + 1;
    driver.ask(json!({"cmd": "drop", "range": [n, n + LARGE_GAP]}));
    n = driver.publish_many(LARGE_GAP + 1, 1_000) + 1;
    taken += 4 + LARGE_GAP + 1;
    wait_batches(&metrics, taken);
    engines.push(n);

    // Engine 2, first seen past its start (its probes dropped): its number goes back.
    let mut n = driver.start();
    n += driver
        .publish(json!([{"events": []}, {"events": []}]))
        .len() as u64;
    taken += n;
    wait_batches(&metrics, taken);
    engines.push(n);

    // Engine 3, whose first batch the agent sees is numbered past engine 2's last.
    let mut n = driver.start();
    let past = engines[1] + 3;
    driver.ask(json!({"cmd": "drop", "range": [n, n + past]}));
    n = driver.publish_many(past + 2, 50_000) + 1;
    taken += n;
    wait_batches(&metrics, taken);
    engines.push(n);

    let counter = |name: &str| metric(&metrics, name).unwrap_or(0);

    // The connection drops and comes back, the engine the same: checked, nothing
    // missing, nothing counted as recovered.
    let recovered = counter("kvscope_agent_kv_gaps_recovered_total");
    driver.ask(json!({"cmd": "relay_restart"}));
    // The agent is back (it retries after 100 ms) before the next batches.
    std::thread::sleep(Duration::from_millis(1500));
    driver.publish(json!([{"events": []}, {"events": []}]));
    *engines.last_mut().unwrap() += 2;
    taken += 2;
    wait_batches(&metrics, taken);
    assert_eq!(
        counter("kvscope_agent_kv_gaps_recovered_total"),
        recovered,
        "{engine} {version}: a reconnection to the same engine counted as a recovery"
    );

    // Engine 4, behind a dropped connection, numbered exactly as far as engine 3: its
    // first batch the agent sees follows on from engine 3's last.
    let last = engines[2] - 1;
    driver.ask(json!({"cmd": "relay_restart"}));
    let mut n = driver.start();
    std::thread::sleep(Duration::from_millis(1500));
    driver.ask(json!({"cmd": "drop", "range": [n, last + 1]}));
    n = driver.publish_many(last + 1 - n + 2, 90_000) + 1;
    taken += n;
    wait_batches(&metrics, taken);
    engines.push(n);

    let resets = counter("kvscope_agent_kv_sequence_resets_total");
    let gaps = counter("kvscope_agent_kv_sequence_gaps_total");
    let left_out: Vec<(&str, u64)> = FieldsLeftOut::default()
        .counts()
        .into_iter()
        .map(|(f, _)| {
            (
                f,
                counter(&format!("kvscope_agent_kv_fields_left_out_{f}_total")),
            )
        })
        .collect();
    let refusals: Vec<(&str, u64)> = want_refusals
        .iter()
        .map(|(c, _)| {
            let name = match *c {
                "salts_inherited" | "media_blocks_without_placeholders" => {
                    format!("kvscope_agent_kv_{c}_total")
                }
                c => format!("kvscope_agent_kv_events_refused_{c}_total"),
            };
            (*c, counter(&name))
        })
        .collect();
    agent.stop(Duration::from_secs(5));
    driver.ask(json!({"cmd": "stop"}));
    drop(driver);
    drop(nats);

    let rec = read_recording(&recording).unwrap();
    let batches: Vec<&kvscope_wire::KvEventBatch> = rec
        .envelopes
        .iter()
        .filter_map(|e| match &e.record {
            Record::KvEvents(b) => Some(b),
            _ => None,
        })
        .collect();
    // Every engine's batches exactly once, in order, the first marked as its start.
    let mut at = 0;
    for (i, &numbered) in engines.iter().enumerate() {
        let of_engine = &batches[at..(at + numbered as usize).min(batches.len())];
        let seqs: Vec<u64> = of_engine.iter().map(|b| b.seq).collect();
        assert!(
            seqs.iter().copied().eq(0..numbered),
            "{engine} {version}, engine {}: batches {:?}… of {numbered}",
            i + 1,
            &seqs[..seqs.len().min(20)]
        );
        let start = if i == 0 {
            SequenceStatus::First
        } else {
            SequenceStatus::Reset
        };
        assert_eq!(
            of_engine[0].sequence,
            start,
            "{engine} {version}, engine {}",
            i + 1
        );
        let odd: Vec<(u64, SequenceStatus)> = of_engine[1..]
            .iter()
            .filter(|b| {
                !matches!(
                    b.sequence,
                    SequenceStatus::InOrder | SequenceStatus::Replayed
                )
            })
            .map(|b| (b.seq, b.sequence))
            .collect();
        assert!(
            odd.is_empty(),
            "{engine} {version}, engine {}: {odd:?}",
            i + 1
        );
        at += numbered as usize;
    }
    assert_eq!(
        at,
        batches.len(),
        "{engine} {version}: batches beyond the engines'"
    );
    // The 17,000 batches of the large gap came in more than one answer (one holds at
    // most 16,384; vLLM before 0.33 also drops what its ROUTER cannot queue), yet all
    // of them, once each, in order (above).
    assert_eq!((resets, gaps), (3, 0), "{engine} {version}: resets, gaps");

    // Every field decoded.
    for (seq, want) in field_seqs.iter().zip(&want_events) {
        let b = batches[*seq as usize];
        assert_eq!(&b.events, want, "{engine} {version}, batch {seq}");
    }
    // The batch's data-parallel rank (vLLM's batches have one from 0.9.1 on).
    let has_rank = fields["KVEventBatch"].as_array().unwrap().len() > 2;
    assert_eq!(
        batches[field_seqs[1] as usize].worker.dp_rank,
        u32::from(has_rank)
    );
    assert_eq!(batches[field_seqs[0] as usize].worker.dp_rank, 0);
    // Each field not carried, counted once per event that had it.
    let want: Vec<(&str, u64)> = want_left_out
        .counts()
        .into_iter()
        .map(|(f, n)| (f, u64::from(n)))
        .collect();
    assert_eq!(left_out, want, "{engine} {version}: fields left out");
    // What a router does not take, refused and counted; a salted chain's continuation
    // salted as its first block.
    assert_eq!(refusals, want_refusals, "{engine} {version}: refused");
    shape
}

/// The versions CI runs: vLLM from before its events became maps (positional arrays)
/// and two after, the newest included; SGLang's newest. `scripts/engine-matrix` runs
/// every published one.
const CI_MATRIX: &str = "vllm:0.23.0 vllm:0.33.0 vllm:0.34.0 sglang:0.5.23";

/// Every `ENGINE:VERSION` of `KVSCOPE_ENGINE_MATRIX` (default [`CI_MATRIX`]), each
/// run to its end whatever the others did, one table row each; the test fails if any
/// is not exact.
#[test]
fn every_engine_publisher_in_the_matrix() {
    let matrix = std::env::var("KVSCOPE_ENGINE_MATRIX").unwrap_or_else(|_| CI_MATRIX.into());
    println!("| engine | version | events | fields counted, not carried | result |");
    println!("|---|---|---|---|---|");
    let mut failed = Vec::new();
    for entry in matrix.split_whitespace() {
        let (engine, version) = entry
            .split_once(':')
            .unwrap_or_else(|| panic!("{entry:?} is not ENGINE:VERSION"));
        let dir = kvscope_lab::paths::default_lab_dir()
            .join(engine)
            .join(version);
        if dir.join("NO_PUBLISHER").is_file() {
            println!("| {engine} | {version} | — | — | no KV event publisher in this release |");
            continue;
        }
        let run = std::panic::catch_unwind(|| run_version(engine, version));
        let (events, not_carried, result) = match run {
            Ok(shape) => (
                if shape.positional {
                    "positional"
                } else {
                    "maps"
                },
                shape.not_carried.join(", "),
                "exact".to_string(),
            ),
            Err(e) => {
                let why = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failed.push(entry);
                (
                    "?",
                    String::new(),
                    format!("**not exact**: {}", why.lines().next().unwrap_or("")),
                )
            }
        };
        println!("| {engine} | {version} | {events} | {not_carried} | {result} |");
    }
    assert!(failed.is_empty(), "not exact: {failed:?}");
}
