//! The migration data plane's HTTP API as the tests drive it (`kvscope-nixl-lab serve`):
//! a directive from decode worker 100's NIXL agent `decode-0` to worker 101's `decode-1`,
//! and posting one.

use kvscope_wire::directive::{BlockRange, MigrationDirective, Prediction};
use kvscope_wire::WorkerKey;

fn worker(id: u64) -> WorkerKey {
    WorkerKey {
        worker_id: id,
        dp_rank: 0,
    }
}

/// Move the blocks `hashes` (after `parent`) of `block_size` tokens from worker 100 to
/// worker 101, under the idempotency key `key`; its prediction is a fixed, plausible one.
pub fn directive(
    key: &str,
    hashes: &[u64],
    parent: Option<u64>,
    block_size: u32,
) -> MigrationDirective {
    MigrationDirective {
        idempotency_key: key.into(),
        request_id: format!("req-{key}"),
        session_id: None,
        source: worker(100),
        target: worker(101),
        source_nixl_agent: Some("decode-0".into()),
        target_nixl_agent: Some("decode-1".into()),
        blocks: BlockRange {
            first: 1,
            count: hashes.len() as u32,
            block_size,
        },
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        tokens: hashes.len() as u64 * u64::from(block_size),
        decided_ns: 1,
        issued_ns: 2,
        predicted: Prediction {
            tokens: 48,
            bytes: 3 * 4096,
            handshake_s: 0.001,
            transfer_s: 0.001,
            dispatch_overhead_s: 0.0,
            migrate_s: 0.002,
            recompute_s: 1.0,
            prefill_tok_per_s: 48.0,
            net_benefit_s: 0.998,
        },
    }
}

/// POST `d` to the data plane at `url` (with `token` as bearer when given): the status
/// and the body.
///
/// # Panics
/// When the endpoint does not answer (this is test support).
pub async fn post(
    http: &reqwest::Client,
    url: &str,
    d: &MigrationDirective,
    token: Option<&str>,
) -> (u16, String) {
    let mut req = http
        .post(format!("{url}/v1/migrations"))
        .header("Idempotency-Key", &d.idempotency_key)
        .json(d);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("the directive endpoint answers");
    (
        resp.status().as_u16(),
        resp.text().await.unwrap_or_default(),
    )
}
