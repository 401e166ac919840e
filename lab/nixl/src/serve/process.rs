//! Starting `kvscope-nixl-lab serve` as a child process (for tests and the loop lab):
//! spawn it, wait for its ready line, stop it with SIGTERM.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use kvscope_lab::process::{stop_all, ManagedProcess};
use std::time::Duration;

use super::{ServeReady, ServeWorker};

/// A running `serve` process. Dropping it stops it.
pub struct ServeProcess {
    pub process: ManagedProcess,
    pub ready: ServeReady,
}

impl ServeProcess {
    /// Start `exe serve` with these workers and token, stderr appended to `log`, and wait
    /// (at most `wait`) for the JSON line it prints once its agents, publishers and
    /// endpoint are up. `extra` are more `serve` arguments.
    pub fn start(
        exe: &Path,
        workers: &[ServeWorker],
        token: &str,
        log: &Path,
        extra: &[&str],
        wait: Duration,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(extra);
        for w in workers {
            let mut spec = format!(
                "name={},worker_id={},dp_rank={},kv={}",
                w.name, w.worker.worker_id, w.worker.dp_rank, w.kv_bind
            );
            if let Some(e) = &w.engine {
                spec.push_str(&format!(",engine={e}"));
            }
            if let Some(f) = &w.sidecar {
                spec.push_str(&format!(",sidecar={}", f.display()));
            }
            cmd.arg("--worker").arg(spec);
        }
        let stderr =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        use std::os::unix::process::CommandExt;
        cmd.env("KVSCOPE_NIXL_LAB_TOKEN", token)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} serve", exe.display()))?;
        let stdout = child.stdout.take().context("serve's stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(wait) {
            Ok(l) if !l.trim().is_empty() => l,
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!(
                    "kvscope-nixl-lab serve did not come up within {wait:?}; see {}",
                    log.display()
                );
            }
        };
        let ready: ServeReady = serde_json::from_str(line.trim())
            .with_context(|| format!("serve's ready line {line:?}"))?;
        Ok(Self {
            process: ManagedProcess {
                name: "nixl-lab-serve".into(),
                child,
                log: log.to_path_buf(),
            },
            ready,
        })
    }

    /// The directive endpoint's base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.ready.listen)
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        stop_all(std::slice::from_mut(&mut self.process), grace);
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}
