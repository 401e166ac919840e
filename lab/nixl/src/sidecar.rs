//! `kvscope-nixl-lab worker --control`: one worker as an engine's sidecar. It runs inside
//! an engine's process tree (the lab starts it under each mocker, as a vLLM engine's NIXL
//! agent runs under Dynamo's worker process), holds one NIXL agent and the engine's own
//! KV event publisher (vLLM's format: the blocks migrated to it), and takes the
//! coordinator's commands (`serve`) over a TCP control connection on loopback, one JSON
//! object per line as on a worker process's stdin. When up it writes a ready file
//! ([`SidecarReady`]) naming its control address, publisher and NIXL listener, which the
//! coordinator waits for.

use std::io::{BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use zeromq::{Socket, SocketSend};

use crate::protocol::{Command, Reply, WorkerSpec, LINE_PREFIX};
use crate::worker::Worker;

/// What a sidecar writes to its ready file once it can take commands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SidecarReady {
    pub name: String,
    pub pid: u32,
    /// The control address (`127.0.0.1:PORT`).
    pub control: String,
    /// Its KV event publisher (`tcp://127.0.0.1:PORT`).
    pub kv_endpoint: String,
    pub nixl_listen_port: u16,
}

/// Run a sidecar: the NIXL agent of `spec` (its listener port picked here when 0), the
/// publisher bound on `kv_bind`, the control socket on `control`; write `ready_file`;
/// serve one coordinator until `Shutdown` or its connection ends. `deadline` bounds the
/// whole life of the process.
pub fn serve(
    mut spec: WorkerSpec,
    control: &str,
    kv_bind: &str,
    ready_file: &Path,
    deadline: Duration,
) -> Result<(), String> {
    crate::worker::exit_after(deadline);
    if spec.listen_port == 0 {
        // Held until just before the agent binds it.
        let held = kvscope_lab::ports::reserve_ports(1).map_err(|e| e.to_string())?;
        spec.listen_port = held.ports()[0];
    }
    let (publish, kv_endpoint) = publisher(kv_bind)?;
    let listener = TcpListener::bind(control)
        .map_err(|e| format!("binding the control socket {control}: {e}"))?;
    let control = listener.local_addr().map_err(|e| e.to_string())?;
    let mut worker = Worker::new(spec.clone()).map_err(|e| e.to_string())?;
    let ready = SidecarReady {
        name: spec.name.clone(),
        pid: std::process::id(),
        control: control.to_string(),
        kv_endpoint,
        nixl_listen_port: spec.listen_port,
    };
    // Written whole, then renamed: a reader never sees half of it.
    let tmp = ready_file.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&ready).map_err(|e| e.to_string())?)
        .and_then(|_| std::fs::rename(&tmp, ready_file))
        .map_err(|e| format!("writing {}: {e}", ready_file.display()))?;
    let (stream, _) = listener
        .accept()
        .map_err(|e| format!("accepting the coordinator: {e}"))?;
    let out = std::sync::Mutex::new(stream.try_clone().map_err(|e| e.to_string())?);
    let send = |reply: &Reply| -> Result<(), String> {
        let line = serde_json::to_string(reply).map_err(|e| e.to_string())?;
        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(out, "{LINE_PREFIX}{line}")
            .and_then(|_| out.flush())
            .map_err(|e| e.to_string())
    };
    let shut_down = crate::worker::serve_lines(BufReader::new(stream), send, |cmd| match cmd {
        Command::Publish { events } => match publish.send(events) {
            Ok(()) => Reply::default(),
            Err(_) => Reply::failed("the KV event publisher is gone"),
        },
        cmd => worker.handle(cmd),
    })?;
    if !shut_down {
        // The coordinator is gone: release everything in order anyway.
        let _ = worker.handle(Command::Shutdown);
    }
    Ok(())
}

/// A vLLM-format publisher on its own thread: batches in, `[topic "", seq, payload]` out.
fn publisher(
    bind: &str,
) -> Result<
    (
        tokio::sync::mpsc::UnboundedSender<Vec<kvscope_wire::KvEvent>>,
        String,
    ),
    String,
> {
    // A tokio channel: the runtime must stay free to accept subscribers while it waits.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<kvscope_wire::KvEvent>>();
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let bind = bind.to_string();
    std::thread::Builder::new()
        .name("kv-publisher".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = bound_tx.send(Err(e.to_string()));
                    return;
                }
            };
            rt.block_on(async move {
                let mut socket = zeromq::PubSocket::new();
                match socket.bind(&bind).await {
                    Ok(ep) => {
                        let _ = bound_tx.send(Ok(ep.to_string()));
                    }
                    Err(e) => {
                        let _ = bound_tx.send(Err(format!("binding {bind}: {e}")));
                        return;
                    }
                }
                let mut seq = 0u64;
                while let Some(events) = rx.recv().await {
                    if let Some(m) = kv_message(seq, &events) {
                        if let Err(e) = socket.send(m).await {
                            eprintln!("kvscope-nixl-lab worker: publishing KV events: {e}");
                        }
                    }
                    seq += 1;
                }
            });
        })
        .map_err(|e| e.to_string())?;
    let endpoint = bound_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|e| format!("the KV event publisher did not start: {e}"))??;
    Ok((tx, endpoint))
}

/// One batch as vLLM publishes it: `[topic "", seq, payload]`, stamped now.
pub fn kv_message(seq: u64, events: &[kvscope_wire::KvEvent]) -> Option<zeromq::ZmqMessage> {
    let ts = crate::worker::unix_ns() as f64 / 1e9;
    let parts = kvscope_wire::vllm_events::frames(
        b"",
        seq,
        kvscope_wire::vllm_events::encode_payload(ts, events, 0),
    );
    let msg: Vec<bytes::Bytes> = parts.into_iter().map(bytes::Bytes::from).collect();
    zeromq::ZmqMessage::try_from(msg).ok()
}
