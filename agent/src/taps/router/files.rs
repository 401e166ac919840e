//! Router logs found by a pattern. On Kubernetes a frontend's log is
//! `/var/log/pods/<namespace>_<pod>_<uid>/<container>/<restarts>.log`: its path changes
//! with every pod and every container restart, and a fleet runs several frontends. So
//! `router_log` may be a glob (`/var/log/pods/dynamo_*frontend*/*/*.log`), looked up
//! again every few seconds:
//!
//! - each matching file is followed as its own source, with its own decision joiner (a
//!   frontend's routing input and its choice are in its own log);
//! - in one folder only the newest file is live (a container's earlier restarts keep
//!   their logs beside it): an older one is read to its end, then let go;
//! - a file that no longer matches (its pod deleted) is let go;
//! - a file present when the agent starts is read from its end (or its start, with
//!   `from_start`); one that appears later is read from its start, so nothing a new
//!   frontend wrote before the next look is missed.

use crate::counters::AgentStats;
use crate::internal_events::{InternalEvent, RouterLogFollowed, RouterLogReleased};
use crate::sink::RecordSink;
use crate::taps::router::follower::{self, LogSource};
use crate::taps::router::join::DecisionSource;
use crate::taps::router::tap::{self, RouterTap};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::task::JoinHandle;

/// Whether `router_log` is a pattern rather than one path.
pub(crate) fn is_pattern(router_log: &str) -> bool {
    router_log.contains(['*', '?', '['])
}

/// What each followed file gets.
#[derive(Debug, Clone)]
pub struct FollowSettings {
    pub from_start: bool,
    pub poll: Duration,
    pub max_line_bytes: usize,
    pub join_timeout_ns: u64,
    pub decisions: DecisionSource,
    /// Which field of a request's arrival line names its tenant, when told.
    pub tenant_field: Option<crate::taps::router::join::TenantField>,
    pub reorder_window_ns: u64,
    pub request_trace_window_ns: u64,
    /// How often the pattern is looked up again.
    pub rescan: Duration,
    /// Where a followed file that cannot be read is told (readiness). A pattern that
    /// matches nothing is not unreadable: most nodes run no frontend.
    pub states: Arc<crate::watchdog::SourceStates>,
}

/// One followed file.
struct Followed {
    stop: Arc<AtomicBool>,
    tap: JoinHandle<()>,
    source: crate::sink::SourceId,
}

/// Stops every follower when the task ends (shutdown aborts it).
#[derive(Default)]
struct Followers(BTreeMap<PathBuf, Followed>);

impl Drop for Followers {
    fn drop(&mut self) {
        for f in self.0.values() {
            f.stop.store(true, Ordering::Relaxed);
            f.tap.abort();
        }
    }
}

/// Follow one log file as a source of its own: a follower thread feeding a router tap.
/// `name` is the source's name on `/metrics`.
pub(crate) fn follow_one(
    source: LogSource,
    name: &str,
    s: &FollowSettings,
    sink: &Arc<RecordSink>,
    stats: &Arc<AgentStats>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<(JoinHandle<()>, crate::sink::SourceId)> {
    let (tx, rx) = tokio::sync::mpsc::channel(10_000);
    let budget = follower::LineBudget::new(follower::LINE_BUDGET_BYTES);
    follower::spawn(
        source,
        s.max_line_bytes,
        tx,
        budget.clone(),
        stats.clone(),
        s.states.clone(),
        stop,
    )?;
    let tap = RouterTap::new(s.join_timeout_ns, s.max_line_bytes, s.decisions)
        .with_tenant_field(s.tenant_field.clone());
    let id = sink.add_source(name, s.reorder_window_ns);
    let task = tokio::spawn(tap::run(
        tap,
        rx,
        budget,
        sink.clone(),
        id,
        s.request_trace_window_ns,
        stats.clone(),
    ));
    Ok((task, id))
}

/// The live file of each folder among `pattern`'s matches: the newest by modification
/// time (then by name).
fn live_matches(pattern: &str) -> Vec<PathBuf> {
    let Ok(paths) = glob::glob(pattern) else {
        return Vec::new();
    };
    let mut newest: BTreeMap<PathBuf, (SystemTime, PathBuf)> = BTreeMap::new();
    for p in paths.flatten().filter(|p| p.is_file()) {
        let modified = std::fs::metadata(&p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let dir = p.parent().map(Path::to_path_buf).unwrap_or_default();
        let e = newest.entry(dir).or_insert((modified, p.clone()));
        if (modified, &p) > (e.0, &e.1) {
            *e = (modified, p);
        }
    }
    newest.into_values().map(|(_, p)| p).collect()
}

/// Follow what `pattern` matches until the task is aborted.
pub async fn run(
    pattern: String,
    s: FollowSettings,
    sink: Arc<RecordSink>,
    stats: Arc<AgentStats>,
) {
    let mut followed = Followers::default();
    let mut first = true;
    loop {
        let pattern_ = pattern.clone();
        let live = tokio::task::spawn_blocking(move || live_matches(&pattern_))
            .await
            .unwrap_or_default();
        let gone: Vec<PathBuf> = followed
            .0
            .keys()
            .filter(|p| !live.contains(p))
            .cloned()
            .collect();
        for path in gone {
            // Read to its end first: the follower polls far more often than this.
            tokio::time::sleep(s.poll * 5).await;
            if let Some(f) = followed.0.remove(&path) {
                f.stop.store(true, Ordering::Relaxed);
                // The tap ends once the follower's channel closes.
                let _ = tokio::time::timeout(Duration::from_secs(5), f.tap).await;
                sink.retire_source(f.source);
                RouterLogReleased { path: &path }.emit(&stats);
            }
        }
        for path in live {
            if followed.0.contains_key(&path) {
                continue;
            }
            let from_start = !first || s.from_start;
            let stop = Arc::new(AtomicBool::new(false));
            let source = LogSource::File {
                path: path.clone(),
                from_start,
                poll: s.poll,
            };
            let name = format!("router_log:{}", path.display());
            match follow_one(source, &name, &s, &sink, &stats, stop.clone()) {
                Ok((tap, source)) => {
                    RouterLogFollowed {
                        path: &path,
                        from_start,
                    }
                    .emit(&stats);
                    followed.0.insert(path, Followed { stop, tap, source });
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "Cannot follow a router log; trying again at the next look.")
                }
            }
        }
        first = false;
        tokio::time::sleep(s.rescan).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_s_newest_file_is_its_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let pod = |name: &str| {
            let p = dir.path().join(name).join("frontend");
            std::fs::create_dir_all(&p).unwrap();
            p
        };
        let (a, b) = (pod("dynamo_frontend-a_1"), pod("dynamo_frontend-b_2"));
        std::fs::write(a.join("0.log"), "x").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(a.join("1.log"), "x").unwrap();
        std::fs::write(b.join("0.log"), "x").unwrap();
        std::fs::write(b.join("0.log.20261201-000000"), "rotated").unwrap();
        let pattern = format!("{}/dynamo_frontend-*/frontend/*.log", dir.path().display());
        assert!(is_pattern(&pattern));
        assert!(!is_pattern("/var/log/dynamo/frontend.log"));
        assert_eq!(
            live_matches(&pattern),
            vec![a.join("1.log"), b.join("0.log")]
        );
    }
}
