//! Shared by the agent's integration tests: the lab's Python (pyzmq) and the real
//! mocker messages captured in `lab/fixtures/samples`.

use std::path::PathBuf;

/// The lab venv's Python (pyzmq), as `scripts/setup` makes it.
pub fn python() -> PathBuf {
    kvscope_lab::paths::venv_python(&kvscope_lab::paths::default_lab_dir())
}

/// The captured ZMQ messages of a Dynamo 1.6.1 mocker (frames in hex and base64).
pub fn mocker_sample() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lab/fixtures/samples/kv_events_mocker.json"
    );
    serde_json::from_slice(&std::fs::read(path).expect("the captured mocker sample"))
        .expect("valid sample JSON")
}
