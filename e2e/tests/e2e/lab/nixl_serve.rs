//! `kvscope-nixl-lab serve` on the real NIXL 1.5.1 wheel: two workers follow their
//! engines' vLLM-format KV events (published here on real ZMQ sockets), take the
//! actuator's `MigrationDirective`s over HTTP and perform them over NIXL (handshake +
//! READ + data check), then publish the migrated blocks as KV events of the target.
//! Needs `kvscope-nixl-lab setup` (fails saying so otherwise).

use std::time::{Duration, Instant};

use kvscope_e2e::data_plane::{directive, post};
use kvscope_nixl_lab::serve::process::ServeProcess;
use kvscope_nixl_lab::serve::{MigrationOutcome, ServeStatus, ServeWorker};
use kvscope_wire::hashing::{local_block_hashes, DYNAMO_HASH_SEED};
use kvscope_wire::vllm_events::{decode_payload, encode_payload, frames, split_frames};
use kvscope_wire::{sequence_hashes, KvEvent};
use zeromq::{Socket, SocketRecv, SocketSend};

const TOKEN: &str = "serve-test-token-0123456789";
const BS: usize = 16;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS as u32,
        local_hashes: None,
        lora_name: None,
        medium: None,
        cache_salt: None,
    }
}

async fn status(http: &reqwest::Client, url: &str) -> ServeStatus {
    http.get(format!("{url}/v1/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directives_migrate_blocks_over_nixl_and_the_target_publishes_them() {
    kvscope_nixl_lab::NixlLibs::locate(&kvscope_lab::paths::default_lab_dir())
        .unwrap_or_else(|e| panic!("{e}"));
    // Two engines: engine 0 holds a 4-block prompt, engine 1 only its first block.
    let mut engines = Vec::new();
    let mut endpoints = Vec::new();
    for _ in 0..2 {
        let mut pubs = zeromq::PubSocket::new();
        let ep = pubs.bind("tcp://127.0.0.1:0").await.unwrap();
        endpoints.push(ep.to_string());
        engines.push(pubs);
    }
    let tokens: Vec<u32> = (0..(4 * BS) as u32).map(|t| 7000 + t * 3).collect();
    let chain = sequence_hashes(&local_block_hashes(&tokens, BS, DYNAMO_HASH_SEED));
    let e0 = [0xa0, 0xa1, 0xa2, 0xa3];
    let e1 = [0xb0];

    let dir = tempfile::tempdir().unwrap();
    let workers: Vec<ServeWorker> = (0..2)
        .map(|i| {
            format!(
                "name=decode-{i},worker_id={},engine={}",
                100 + i,
                endpoints[i]
            )
            .parse()
            .unwrap()
        })
        .collect();
    let serve = ServeProcess::start(
        kvscope_nixl_lab::lab_binary().as_ref(),
        &workers,
        TOKEN,
        &dir.path().join("serve.log"),
        &[],
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let url = serve.url();
    let http = reqwest::Client::new();
    assert_eq!(serve.ready.workers.len(), 2);

    // Tap the target's publisher as the agent would.
    let mut tap = zeromq::SubSocket::new();
    tap.connect(&serve.ready.workers[1].kv_endpoint)
        .await
        .unwrap();
    tap.subscribe("").await.unwrap();

    // The engines publish until the lab's books hold their blocks (ZMQ drops messages
    // sent before a subscriber joins; repeating a store is harmless).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seq = 0;
    loop {
        for (i, (pubs, ev)) in engines
            .iter_mut()
            .zip([stored(&e0, None, &tokens), stored(&e1, None, &tokens[..BS])])
            .enumerate()
        {
            let f = frames(b"", seq, encode_payload(1.0e9 + i as f64, &[ev], 0));
            let msg: Vec<bytes::Bytes> = f.into_iter().map(bytes::Bytes::from).collect();
            pubs.send(zeromq::ZmqMessage::try_from(msg).unwrap())
                .await
                .unwrap();
        }
        seq += 1;
        let st = status(&http, &url).await;
        if st.workers[0].book_blocks == 4 && st.workers[1].book_blocks == 1 {
            assert_eq!(st.workers[0].book_faults.unknown_parent, 0);
            assert_eq!(st.workers[0].engine_events_skipped, 0);
            assert_eq!(st.workers[0].engine_messages_undecodable, 0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lab's books never held the engines' blocks: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Without the token: 401, nothing done.
    let d = directive("k-1", &chain[1..4], Some(chain[0]), BS as u32);
    assert_eq!(post(&http, &url, &d, None).await.0, 401);

    // The migration: 200, three blocks READ over NIXL and checked.
    let (code, body) = post(&http, &url, &d, Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    let o: MigrationOutcome = serde_json::from_str(&body).unwrap();
    assert_eq!(o.outcome, "migrated");
    assert_eq!((o.blocks, o.bytes), (3, 3 * 4096));
    assert_eq!(o.transfers, 1);
    assert!(o.handshakes >= 2, "invalidate + load of the source: {o:?}");
    assert_eq!(o.handshakes_failed, 0);

    // The target published the blocks as its engine would: the source engine's block
    // hashes, under the target's own hash of the block they extend, with their tokens.
    let msg = tokio::time::timeout(Duration::from_secs(10), tap.recv())
        .await
        .expect("the target published the migrated blocks")
        .unwrap()
        .into_vec();
    let (first_seq, payload) = split_frames(&msg).unwrap();
    assert_eq!(first_seq, 0);
    let p = decode_payload(payload).unwrap();
    assert_eq!(p.events, vec![stored(&e0[1..], Some(e1[0]), &tokens[BS..])]);

    // Idempotent: the same key again is a 409 carrying the first outcome.
    let (code, body) = post(&http, &url, &d, Some(TOKEN)).await;
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("\"migrated\""), "{body}");

    // Blocks the source does not hold: refused with the reason, nothing transferred.
    let (code, body) = post(
        &http,
        &url,
        &directive("k-2", &[42], None, BS as u32),
        Some(TOKEN),
    )
    .await;
    assert_eq!(code, 422, "{body}");
    assert!(body.contains("no longer holds 1 of the 1 blocks"), "{body}");

    // Injected handshake failures: the target's loadRemoteMD of the mangled metadata
    // fails (NIXL_ERR_MISMATCH); 502, so the actuator retries with the same key.
    let inject = |on: bool| {
        http.post(format!("{url}/v1/inject"))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({ "handshake_failures": on }))
            .send()
    };
    assert_eq!(inject(true).await.unwrap().status().as_u16(), 200);
    let d3 = directive("k-3", &chain[1..3], Some(chain[0]), BS as u32);
    let (code, body) = post(&http, &url, &d3, Some(TOKEN)).await;
    assert_eq!(code, 502, "{body}");
    let o: MigrationOutcome = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (o.outcome.as_str(), o.handshakes_failed, o.transfers),
        ("handshake_failed", 1, 0)
    );
    // Healed, the same key goes through.
    assert_eq!(inject(false).await.unwrap().status().as_u16(), 200);
    let (code, body) = post(&http, &url, &d3, Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");

    let st = status(&http, &url).await;
    let c = st.directives;
    assert_eq!(
        (
            c.received,
            c.migrated,
            c.duplicate,
            c.rejected,
            c.failed,
            c.unauthorized
        ),
        (5, 2, 1, 1, 1, 1),
        "{c:?}"
    );
    assert_eq!(st.workers[1].published_batches, 2);
}
