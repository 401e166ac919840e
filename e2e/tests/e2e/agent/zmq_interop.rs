//! The agent's own ZMTP client (`kvscope_agent::taps::engine::zmtp`) as a SUB against a real libzmq
//! PUB (pyzmq), with the frames a Dynamo 1.6.1 mocker really sent (lab/fixtures/samples).

use kvscope_agent::taps::engine::zmtp::{Connection, Limits, SocketType};
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::support;
use support::{mocker_sample, python};

#[tokio::test]
async fn the_zmtp_client_subscribes_to_a_pyzmq_pub() {
    let dir = tempfile::tempdir().unwrap();
    let sample: serde_json::Value = mocker_sample();
    let spec = serde_json::json!({ "messages": sample["messages"] });
    let spec_path = dir.path().join("spec.json");
    std::fs::write(&spec_path, serde_json::to_vec(&spec).unwrap()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let mut cmd = Command::new(python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/e2e/agent/support/kv_publisher.py"
    ))
    .arg(&endpoint)
    .arg(&spec_path)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    // Stopped on drop: a failing assertion or a receive timeout must not leak it.
    let mut publisher = StopOnDrop(vec![ManagedProcess::spawn_with_stdio("kv_publisher", cmd)
        .expect("the lab venv's python with pyzmq")]);
    let child = &mut publisher[0].child;
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "bound");

    let mut sub = Connection::connect(
        &endpoint,
        SocketType::Sub,
        Limits::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(sub.peer_socket_type, "XPUB");
    sub.subscribe(b"").await.unwrap();
    let mut got = Vec::new();
    for _ in 0..sample["messages"].as_array().unwrap().len() {
        let msg = tokio::time::timeout(Duration::from_secs(20), sub.recv())
            .await
            .unwrap()
            .unwrap();
        got.push(msg);
    }
    let child = &mut publisher[0].child;
    drop(child.stdin.take());
    let _ = child.wait();
    publisher.clear();
    for (m, frames) in sample["messages"].as_array().unwrap().iter().zip(&got) {
        let want: Vec<String> = m["frames_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap().to_string())
            .collect();
        let have: Vec<String> = frames
            .iter()
            .map(|f| f.iter().map(|b| format!("{b:02x}")).collect())
            .collect();
        assert_eq!(have, want);
    }
}
