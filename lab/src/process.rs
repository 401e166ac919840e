//! Child processes, each the leader of its own process group, so that stopping the lab
//! also stops anything they spawned. Signals go through `/bin/kill` (the workspace
//! denies `unsafe`, so no direct `libc::kill`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tracing::{debug, warn};

/// One started process (and its process group).
#[derive(Debug)]
pub struct ManagedProcess {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl ManagedProcess {
    /// Spawns `cmd` in a new process group with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening log {}", log.display()))?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let mut p = Self::spawn_with_stdio(name, cmd)?;
        p.log = log.to_path_buf();
        Ok(p)
    }

    /// Spawns `cmd` in a new process group, its stdio left as the caller set it (a
    /// test that talks to the child over pipes); `log` stays empty. The group is what
    /// [`stop_all`] signals, so anything the child spawns is stopped with it.
    pub fn spawn_with_stdio(name: &str, mut cmd: Command) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {name}: {cmd:?}"))?;
        debug!(name, pid = child.id(), "Started process.");
        Ok(Self {
            name: name.to_string(),
            child,
            log: PathBuf::new(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` if the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// Processes stopped with [`stop_all`] when this is dropped: a test's processes must not
/// outlive it when one of its assertions panics, where a `stop_all` at its end never
/// runs (a dropped [`Child`] keeps running). Derefs to the `Vec`, so processes are
/// pushed and inspected as in one.
#[derive(Debug, Default)]
pub struct StopOnDrop(pub Vec<ManagedProcess>);

impl StopOnDrop {
    /// Stop them all now, waiting up to `grace` for each to exit after SIGTERM. Stopped
    /// processes are forgotten, so the drop does not signal their (maybe reused) group
    /// ids again.
    pub fn stop(&mut self, grace: Duration) {
        stop_all(&mut self.0, grace);
        self.0.clear();
    }
}

impl std::ops::Deref for StopOnDrop {
    type Target = Vec<ManagedProcess>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for StopOnDrop {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// Sends `signal` (e.g. "TERM", "KILL") to the process group `pgid`. Errors (such as an
/// already empty group) are ignored.
pub fn signal_group(pgid: u32, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// True if any process is still in group `pgid` (zombies included until reaped).
pub fn group_alive(pgid: u32) -> bool {
    Command::new("kill")
        .arg("-0")
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Stops all processes: SIGTERM to every group, wait up to `grace`, then SIGKILL to
/// every group (leaders and any stragglers), and reap the leaders.
pub fn stop_all(procs: &mut [ManagedProcess], grace: Duration) {
    for p in procs.iter_mut() {
        if p.exited().is_none() {
            signal_group(p.pid(), "TERM");
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if procs.iter_mut().all(|p| p.exited().is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for p in procs.iter_mut() {
        if p.exited().is_none() {
            warn!(name = %p.name, pid = p.pid(), "Process ignored SIGTERM; sending SIGKILL.");
        }
        // Always: also takes down children that outlived the group leader.
        signal_group(p.pid(), "KILL");
    }
    for p in procs.iter_mut() {
        let _ = p.child.wait();
    }
}

/// The last `lines` lines of a process's log, colours stripped, for an error message.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::from("(no log)");
    };
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| crate::router_log::strip_ansi(l))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper() -> ManagedProcess {
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        ManagedProcess::spawn("sleep", cmd, Path::new("/dev/null")).unwrap()
    }

    #[test]
    fn processes_are_stopped_when_an_assertion_panics() {
        let mut pgid = 0;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut procs = StopOnDrop::default();
            procs.push(sleeper());
            pgid = procs[0].pid();
            assert!(group_alive(pgid), "the process runs before the panic");
            panic!("a failing assertion in a test");
        }));
        assert!(outcome.is_err());
        assert!(
            !group_alive(pgid),
            "process group {pgid} survived the panic"
        );
    }

    #[test]
    fn a_piped_child_leads_its_own_group_and_is_stopped_with_it() {
        let mut cmd = Command::new("sh");
        // `exec` keeps the pid: the leader the drop reaps (a grandchild's zombie would
        // linger until init reaps it, making the last check racy).
        cmd.args(["-c", "echo started; exec sleep 600"])
            .stdout(Stdio::piped());
        let mut procs = StopOnDrop(vec![ManagedProcess::spawn_with_stdio("sh", cmd).unwrap()]);
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(procs[0].child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "started\n", "stdout stays the caller's pipe");
        let pgid = procs[0].pid();
        // Only a group leader makes `kill -0 -pid` succeed.
        assert!(group_alive(pgid), "the child leads group {pgid}");
        drop(procs);
        assert!(!group_alive(pgid), "the group is gone after the drop");
    }

    #[test]
    fn an_explicit_stop_forgets_the_processes() {
        let mut procs = StopOnDrop(vec![sleeper()]);
        let pgid = procs[0].pid();
        procs.stop(Duration::from_secs(5));
        assert!(procs.is_empty());
        assert!(!group_alive(pgid));
    }
}
