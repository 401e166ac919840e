//! Which TCP and UDP sockets a set of processes holds, and where they point: how a node
//! agent tells which local process serves an endpoint (an engine's own KV publisher and
//! its Dynamo request-plane port belong to one process), and the lab's check that its
//! traffic stays on 127.0.0.1.
//!
//! Read from procfs, as `ss -p` does: each process's `fd/` links name the socket inodes
//! it holds, and `net/{tcp,tcp6,udp,udp6}` give each inode's local and remote address and
//! state. The tables are read through the process's own `/proc/<pid>/net`, so a process
//! in another network namespace is read in its own. The root is overridable so the
//! parsing is tested on fixture text.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// One socket of one process.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SocketInfo {
    pub pid: u32,
    /// The process's `comm`.
    pub process: String,
    pub protocol: &'static str,
    pub local: SocketAddr,
    /// Unspecified (`0.0.0.0:0`) for listeners and unconnected UDP sockets.
    pub remote: SocketAddr,
    /// TCP state (`LISTEN`, `ESTABLISHED`, …); `UDP` for UDP sockets.
    pub state: &'static str,
}

impl SocketInfo {
    pub fn is_listener(&self) -> bool {
        self.state == "LISTEN" || (self.protocol.starts_with("udp") && self.remote.port() == 0)
    }

    /// Whether it is bound to every interface (`0.0.0.0` or `::`).
    pub fn is_wildcard(&self) -> bool {
        self.local.ip().is_unspecified()
    }

    /// Whether its peer, if it has one, is a loopback address.
    pub fn peer_is_loopback(&self) -> bool {
        self.remote.ip().is_unspecified() || is_loopback(self.remote.ip())
    }
}

impl std::fmt::Display for SocketInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} -> {} (pid {} {})",
            self.protocol, self.state, self.local, self.remote, self.pid, self.process
        )
    }
}

/// 127.0.0.0/8, `::1`, or an IPv4-mapped loopback (`::ffff:127.x.y.z`).
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

const TCP_STATES: [&str; 12] = [
    "?",
    "ESTABLISHED",
    "SYN_SENT",
    "SYN_RECV",
    "FIN_WAIT1",
    "FIN_WAIT2",
    "TIME_WAIT",
    "CLOSE",
    "CLOSE_WAIT",
    "LAST_ACK",
    "LISTEN",
    "CLOSING",
];

/// One row of a `/proc/net/{tcp,udp}[6]` table: (inode, local, remote, state).
pub(crate) fn parse_table(
    text: &str,
    protocol: &'static str,
) -> Vec<(u64, SocketAddr, SocketAddr, &'static str)> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local = parse_addr(f.get(1)?)?;
            let remote = parse_addr(f.get(2)?)?;
            let state = u8::from_str_radix(f.get(3)?, 16).ok()?;
            let inode = f.get(9)?.parse().ok()?;
            let state = if protocol.starts_with("udp") {
                "UDP"
            } else {
                TCP_STATES.get(usize::from(state)).copied().unwrap_or("?")
            };
            Some((inode, local, remote, state))
        })
        .collect()
}

/// `0100007F:1F90` (IPv4, the address as a little-endian u32) or 32 hex digits (IPv6,
/// four little-endian u32 words), then the port in hex.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(
            u32::from_str_radix(ip, 16).ok()?.swap_bytes(),
        )),
        32 => {
            let mut bytes = [0u8; 16];
            for w in 0..4 {
                let word = u32::from_str_radix(&ip[w * 8..w * 8 + 8], 16).ok()?;
                bytes[w * 4..w * 4 + 4].copy_from_slice(&word.to_le_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Every TCP and UDP socket held by the processes `pids`, read under `proc_root`
/// (normally `/proc`). A process that is gone is skipped.
pub fn sockets_of(proc_root: &Path, pids: &[u32]) -> Vec<SocketInfo> {
    let mut out = Vec::new();
    for &pid in pids {
        let dir = proc_root.join(pid.to_string());
        let Ok(fds) = std::fs::read_dir(dir.join("fd")) else {
            continue;
        };
        let inodes: HashSet<u64> = fds
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter_map(|l| {
                l.to_str()?
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse()
                    .ok()
            })
            .collect();
        if inodes.is_empty() {
            continue;
        }
        let process = std::fs::read_to_string(dir.join("comm"))
            .map(|c| c.trim().to_string())
            .unwrap_or_default();
        for protocol in ["tcp", "tcp6", "udp", "udp6"] {
            let Ok(text) = std::fs::read_to_string(dir.join("net").join(protocol)) else {
                continue;
            };
            for (inode, local, remote, state) in parse_table(&text, protocol) {
                if inodes.contains(&inode) {
                    out.push(SocketInfo {
                        pid,
                        process: process.clone(),
                        protocol,
                        local,
                        remote,
                        state,
                    });
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Every process under `proc_root`.
pub fn all_pids(proc_root: &Path) -> Vec<u32> {
    std::fs::read_dir(proc_root)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `host:port` of an endpoint (`tcp://h:p`, `h:p/…`).
pub fn host_port(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let hp = rest.split('/').next()?;
    let (host, port) = hp.rsplit_once(':')?;
    Some((
        host.trim_start_matches('[').trim_end_matches(']'),
        port.parse().ok()?,
    ))
}

/// The processes listening on `host:port`: on that address, or on every address. A host
/// that is a name matches any address (the port alone then tells).
pub fn listeners(sockets: &[SocketInfo], host: &str, port: u16) -> BTreeSet<u32> {
    let ip: Option<IpAddr> = host.parse().ok();
    sockets
        .iter()
        .filter(|s| s.state == "LISTEN" && s.local.port() == port)
        .filter(|s| ip.is_none_or(|ip| s.is_wildcard() || s.local.ip() == ip))
        .map(|s| s.pid)
        .collect()
}

/// The process's parent, from `<proc_root>/<pid>/stat` (`None` when gone or for pid 1).
pub(crate) fn parent_of(proc_root: &Path, pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
    let (_, after) = stat.rsplit_once(") ")?;
    after
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
        .filter(|&p| p != 0)
}

/// The process and its ancestors, nearest first, up to (not including) pid 0; at most
/// 64 deep (a loop in a fixture, or a pid reused mid-walk, cannot run away).
pub fn ancestry(proc_root: &Path, pid: u32) -> Vec<u32> {
    let mut chain = vec![pid];
    while chain.len() < 64 {
        match parent_of(proc_root, *chain.last().unwrap_or(&pid)) {
            Some(p) if !chain.contains(&p) => chain.push(p),
            _ => break,
        }
    }
    chain
}

/// The Kubernetes pod a process runs in, from its cgroup path: the `pod<uid>` part the
/// kubelet names pod cgroups with (`kubepods-burstable-pod<uid>.slice` with the systemd
/// driver, `kubepods/burstable/pod<uid>` with cgroupfs). Every container of a pod sits
/// under it. `None` outside a pod.
pub fn pod_of(proc_root: &Path, pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    text.lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .filter(|path| path.contains("kubepods"))
        .flat_map(|path| path.split('/'))
        .find_map(|part| {
            let name = part.strip_suffix(".slice").unwrap_or(part);
            let uid = if name.starts_with("kubepods") {
                name.rsplit_once("-pod")?.1
            } else {
                name.strip_prefix("pod")?
            };
            (!uid.is_empty()).then(|| uid.replace('_', "-"))
        })
}

/// Every process in the process groups `pgids` (the lab starts each child in its own
/// group), read from `<proc_root>/*/stat`.
pub fn pids_in_groups(proc_root: &Path, pgids: &[u32]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut by_group: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp …`; comm may hold spaces and parentheses.
        let Some(after) = stat.rsplit_once(") ").map(|(_, a)| a) else {
            continue;
        };
        if let Some(pgrp) = after.split_whitespace().nth(2).and_then(|g| g.parse().ok()) {
            by_group.entry(pgrp).or_default().push(pid);
        }
    }
    pgids
        .iter()
        .flat_map(|g| by_group.remove(g).unwrap_or_default())
        .collect()
}

/// Samples, every `period`, the sockets of every process in a growing set of process
/// groups, until [`SocketWatch::finish`]: a run's sockets come and go (connections are
/// short-lived), so one look at the end would miss most of them.
pub struct SocketWatch {
    groups: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<SocketInfo>>>,
}

impl SocketWatch {
    pub fn start(groups: Vec<u32>, period: std::time::Duration) -> Self {
        let groups = std::sync::Arc::new(std::sync::Mutex::new(groups));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (g, st) = (groups.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            let proc_root = Path::new("/proc");
            loop {
                let pgids = g.lock().map(|g| g.clone()).unwrap_or_default();
                let pids = pids_in_groups(proc_root, &pgids);
                seen.extend(sockets_of(proc_root, &pids));
                if st.load(std::sync::atomic::Ordering::Relaxed) {
                    return seen.into_iter().collect();
                }
                std::thread::sleep(period);
            }
        });
        Self {
            groups,
            stop,
            thread: Some(thread),
        }
    }

    /// Watch these process groups too from now on.
    pub fn add_groups(&self, more: &[u32]) {
        if let Ok(mut g) = self.groups.lock() {
            g.extend_from_slice(more);
        }
    }

    /// Stop sampling: every distinct socket seen.
    pub fn finish(mut self) -> Vec<SocketInfo> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0000000000000000 100 0 0 10 0
   1: 00000000:2328 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0000000000000000 20 4 30 10 -1
   3: 0A00000A:D431 0200C0C0:01BB 01 00000000:00000000 00:00000000 00000000     0        0 444 1 0000000000000000 20 4 30 10 -1
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:1F92 0000000000000000FFFF00000100007F:C000 01 00000000:00000000 00:00000000 00000000     0        0 666 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn tables_parse_addresses_states_and_inodes() {
        let rows = parse_table(TCP, "tcp");
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[0].0, 111);
        assert_eq!(rows[0].1, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(rows[0].3, "LISTEN");
        assert_eq!(rows[1].1, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(rows[2].2, "127.0.0.1:54321".parse().unwrap());
        assert_eq!(rows[2].3, "ESTABLISHED");
        assert_eq!(rows[3].2, "192.192.0.2:443".parse().unwrap());
        let rows = parse_table(TCP6, "tcp6");
        assert_eq!(rows[0].1, "[::1]:8081".parse().unwrap());
        assert_eq!(rows[1].1, "[::ffff:127.0.0.1]:8082".parse().unwrap());
        assert!(is_loopback(rows[1].2.ip()));
        assert!(!is_loopback("192.0.2.7".parse().unwrap()));
    }

    #[test]
    fn a_process_fixture_is_read_through_its_fd_links() {
        let root = tempfile::tempdir().unwrap();
        let p = root.path().join("42");
        std::fs::create_dir_all(p.join("fd")).unwrap();
        std::fs::create_dir_all(p.join("net")).unwrap();
        std::fs::write(p.join("comm"), "python\n").unwrap();
        std::fs::write(p.join("net/tcp"), TCP).unwrap();
        std::fs::write(p.join("net/tcp6"), TCP6).unwrap();
        std::os::unix::fs::symlink("socket:[222]", p.join("fd/3")).unwrap();
        std::os::unix::fs::symlink("socket:[444]", p.join("fd/4")).unwrap();
        std::os::unix::fs::symlink("/dev/null", p.join("fd/5")).unwrap();
        std::fs::write(p.join("stat"), "42 (py (x) y) S 1 42 42 0").unwrap();
        let s = sockets_of(root.path(), &[42, 43]);
        assert_eq!(s.len(), 2);
        assert!(s[0].is_listener() && s[0].is_wildcard());
        assert!(!s[1].peer_is_loopback());
        assert_eq!(s[1].process, "python");
        assert_eq!(pids_in_groups(root.path(), &[42]), vec![42]);
        assert_eq!(all_pids(root.path()), vec![42]);
        assert_eq!(listeners(&s, "0.0.0.0", 9000), BTreeSet::from([42]));
        assert_eq!(
            listeners(&s, "10.1.2.3", 9000),
            BTreeSet::from([42]),
            "every address"
        );
        assert_eq!(host_port("tcp://127.0.0.1:9000"), Some(("127.0.0.1", 9000)));
        assert_eq!(host_port("10.0.0.1:80/7/ns/c/e"), Some(("10.0.0.1", 80)));
        assert_eq!(parent_of(root.path(), 42), Some(1));
        assert!(
            listeners(&s, "127.0.0.1", 8080).is_empty(),
            "not this process's socket"
        );
    }

    #[test]
    fn ancestry_walks_parents_and_pods_come_from_cgroup_paths() {
        let root = tempfile::tempdir().unwrap();
        let proc = |pid: u32, ppid: u32, cgroup: &str| {
            let p = root.path().join(pid.to_string());
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("stat"), format!("{pid} (a) b) S {ppid} 1 1 0")).unwrap();
            std::fs::write(p.join("cgroup"), cgroup).unwrap();
        };
        proc(1, 0, "0::/init.scope\n");
        proc(10, 1, "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b_2c.slice/cri-containerd-77.scope\n");
        proc(
            11,
            10,
            "12:memory:/kubepods/besteffort/pod0a1b-2c/88\n0::/\n",
        );
        proc(
            12,
            11,
            "0::/kubepods.slice/kubepods-podff.slice/cri-containerd-1.scope\n",
        );
        proc(20, 20, "0::/user.slice\n"); // its own parent: a loop
        assert_eq!(ancestry(root.path(), 12), vec![12, 11, 10, 1]);
        assert_eq!(ancestry(root.path(), 20), vec![20]);
        assert_eq!(ancestry(root.path(), 99), vec![99], "gone: only itself");
        assert_eq!(parent_of(root.path(), 1), None);
        assert_eq!(pod_of(root.path(), 10).as_deref(), Some("0a1b-2c"));
        assert_eq!(pod_of(root.path(), 11).as_deref(), Some("0a1b-2c"));
        assert_eq!(pod_of(root.path(), 12).as_deref(), Some("ff"));
        assert_eq!(pod_of(root.path(), 1), None);
        assert_eq!(pod_of(root.path(), 20), None);
    }
}
