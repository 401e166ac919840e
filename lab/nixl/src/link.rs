//! How the coordinator reaches a worker: a [`Worker`] in this process, a
//! `kvscope-nixl-lab worker` child process spoken to over stdin/stdout, or a sidecar
//! started elsewhere (under an engine) spoken to over its TCP control socket.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use crate::libs::NixlLibs;
use crate::protocol::{Command, Reply, WorkerSpec, LINE_PREFIX};
use crate::worker::{Worker, WorkerError};

/// A worker that cannot be reached.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// An in-process worker could not start.
    #[error(transparent)]
    Start(#[from] WorkerError),
    /// A worker process could not be spawned.
    #[error("spawning worker {name} ({exe}): {source}")]
    Spawn {
        /// Agent name.
        name: String,
        /// Executable.
        exe: String,
        /// The error.
        source: std::io::Error,
    },
    /// A worker process went away (or broke the protocol).
    #[error("worker {name}: {problem}")]
    Broken {
        /// Agent name.
        name: String,
        /// What happened.
        problem: String,
    },
}

/// One worker, wherever it runs.
pub enum WorkerLink {
    /// In this process.
    InProcess(Box<Worker>),
    /// A child process.
    Process(ChildWorker),
    /// A sidecar process (`worker --control`), not ours.
    Sidecar(SidecarWorker),
}

/// A sidecar's control connection.
pub struct SidecarWorker {
    ready: crate::sidecar::SidecarReady,
    out: std::net::TcpStream,
    input: BufReader<std::net::TcpStream>,
}

/// A `kvscope-nixl-lab worker` child.
pub struct ChildWorker {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl WorkerLink {
    /// Starts a worker in this process.
    pub fn in_process(spec: WorkerSpec) -> Result<Self, LinkError> {
        Ok(WorkerLink::InProcess(Box::new(Worker::new(spec)?)))
    }

    /// Spawns `exe worker …` with the libraries' environment.
    pub fn spawn(
        exe: &Path,
        libs: &NixlLibs,
        spec: &WorkerSpec,
        deadline: Duration,
        start_delay: Duration,
    ) -> Result<Self, LinkError> {
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("worker")
            .args(["--name", &spec.name])
            .args(["--listen-port", &spec.listen_port.to_string()])
            .args(["--blocks", &spec.blocks.to_string()])
            .args(["--block-size", &spec.block_size.to_string()])
            .args(["--fill", &spec.fill.to_string()])
            .args(["--listener-delay-us", &spec.listener_delay_us.to_string()])
            .args(["--progress-delay-us", &spec.progress_delay_us.to_string()])
            .args(["--deadline-secs", &deadline.as_secs().max(1).to_string()])
            .args(["--start-delay-ms", &start_delay.as_millis().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        libs.apply_env(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| LinkError::Spawn {
            name: spec.name.clone(),
            exe: exe.display().to_string(),
            source,
        })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(LinkError::Broken {
                name: spec.name.clone(),
                problem: "no stdin/stdout pipes".into(),
            });
        };
        Ok(WorkerLink::Process(ChildWorker {
            name: spec.name.clone(),
            child,
            stdin: Some(stdin),
            stdout: BufReader::new(stdout),
        }))
    }

    /// Connects to the sidecar whose ready file is `ready_file`, waiting up to `wait`
    /// for the file to appear.
    pub fn sidecar(ready_file: &Path, wait: Duration) -> Result<Self, LinkError> {
        let broken = |problem: String| LinkError::Broken {
            name: ready_file.display().to_string(),
            problem,
        };
        let t0 = Instant::now();
        let ready: crate::sidecar::SidecarReady = loop {
            match std::fs::read(ready_file) {
                Ok(b) => break serde_json::from_slice(&b).map_err(|e| broken(e.to_string()))?,
                Err(_) if t0.elapsed() < wait => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(broken(format!("no ready file after {wait:?}: {e}"))),
            }
        };
        let out = std::net::TcpStream::connect(&ready.control)
            .map_err(|e| broken(format!("connecting to {}: {e}", ready.control)))?;
        let input = BufReader::new(out.try_clone().map_err(|e| broken(e.to_string()))?);
        Ok(WorkerLink::Sidecar(SidecarWorker { ready, out, input }))
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        match self {
            WorkerLink::InProcess(_) => std::process::id(),
            WorkerLink::Process(c) => c.child.id(),
            WorkerLink::Sidecar(s) => s.ready.pid,
        }
    }

    /// A sidecar's KV event publisher (none for the others: their owner publishes).
    pub fn kv_endpoint(&self) -> Option<&str> {
        match self {
            WorkerLink::Sidecar(s) => Some(&s.ready.kv_endpoint),
            _ => None,
        }
    }

    /// Sends a command and waits for the reply.
    pub fn call(&mut self, cmd: Command) -> Result<Reply, LinkError> {
        match self {
            WorkerLink::InProcess(w) => Ok(w.handle(cmd)),
            WorkerLink::Process(c) => c.call(&cmd),
            WorkerLink::Sidecar(s) => s.call(&cmd),
        }
    }

    /// After `Shutdown`: waits (up to `grace`) for a worker process to exit.
    pub fn finish(&mut self, grace: Duration) -> Result<(), LinkError> {
        match self {
            WorkerLink::InProcess(_) | WorkerLink::Sidecar(_) => Ok(()),
            WorkerLink::Process(c) => c.finish(grace),
        }
    }
}

impl ChildWorker {
    fn broken(&self, problem: impl Into<String>) -> LinkError {
        LinkError::Broken {
            name: self.name.clone(),
            problem: problem.into(),
        }
    }

    fn call(&mut self, cmd: &Command) -> Result<Reply, LinkError> {
        let line = serde_json::to_string(cmd).map_err(|e| self.broken(e.to_string()))?;
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(self.broken("already finished"));
        };
        if let Err(e) = writeln!(stdin, "{LINE_PREFIX}{line}").and_then(|_| stdin.flush()) {
            return Err(self.broken(format!("writing a command: {e}")));
        }
        let mut buf = String::new();
        loop {
            buf.clear();
            match self.stdout.read_line(&mut buf) {
                Ok(0) => {
                    let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    return Err(self.broken(format!("exited ({status}) before replying")));
                }
                Ok(_) => {
                    if let Some(json) = buf.trim_end().strip_prefix(LINE_PREFIX) {
                        return serde_json::from_str(json)
                            .map_err(|e| self.broken(format!("bad reply: {e}")));
                    }
                    // Not ours (a library printing to stdout): pass it on.
                    eprint!("[{}] {buf}", self.name);
                }
                Err(e) => return Err(self.broken(format!("reading a reply: {e}"))),
            }
        }
    }

    fn finish(&mut self, grace: Duration) -> Result<(), LinkError> {
        drop(self.stdin.take());
        let t0 = Instant::now();
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(self.broken(format!("exited with {status}"))),
                Ok(None) if t0.elapsed() < grace => std::thread::sleep(Duration::from_millis(10)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(
                        self.broken(format!("still running {grace:?} after shutdown; killed"))
                    );
                }
                Err(e) => return Err(self.broken(format!("waiting: {e}"))),
            }
        }
    }
}

impl SidecarWorker {
    fn call(&mut self, cmd: &Command) -> Result<Reply, LinkError> {
        let broken = |problem: String| LinkError::Broken {
            name: self.ready.name.clone(),
            problem,
        };
        let line = serde_json::to_string(cmd).map_err(|e| broken(e.to_string()))?;
        writeln!(self.out, "{LINE_PREFIX}{line}")
            .and_then(|_| self.out.flush())
            .map_err(|e| broken(format!("writing a command: {e}")))?;
        let mut buf = String::new();
        loop {
            buf.clear();
            match self.input.read_line(&mut buf) {
                Ok(0) => return Err(broken("closed the connection before replying".into())),
                Ok(_) => {
                    if let Some(json) = buf.trim_end().strip_prefix(LINE_PREFIX) {
                        return serde_json::from_str(json)
                            .map_err(|e| broken(format!("bad reply: {e}")));
                    }
                }
                Err(e) => return Err(broken(format!("reading a reply: {e}"))),
            }
        }
    }
}

impl Drop for ChildWorker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
