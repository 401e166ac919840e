//! The loopback shim (`shim/loopback_bind.c`, built by `build.rs`): preloaded into a
//! process, it turns every bind to "any address" into a bind to loopback. The labs'
//! processes get it where a program binds `0.0.0.0` and offers no setting for it (NIXL's
//! metadata listener, a Dynamo mocker's KV event sockets).

use std::collections::HashMap;
use std::path::Path;

/// The shim's bytes.
pub const LOOPBACK_SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/loopback_bind.so"));
/// Its file name where a lab writes it.
pub const LOOPBACK_SHIM_FILE: &str = "loopback_bind.so";
/// Libraries the dynamic loader loads first.
pub const LD_PRELOAD_ENV: &str = "LD_PRELOAD";

/// Write the shim to `path` unless it is already there, through a temporary file, so a
/// process never preloads a half-written one.
pub fn write_shim(path: &Path) -> std::io::Result<()> {
    if std::fs::read(path).is_ok_and(|b| b == LOOPBACK_SHIM) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("so.{}", std::process::id()));
    std::fs::write(&tmp, LOOPBACK_SHIM)?;
    std::fs::rename(&tmp, path)
}

/// The TCP sockets listening on "any address" (IPv4 or IPv6) that a process of one of
/// the process groups `groups` holds, each as `name[pid] port`: what the labs must never
/// leave open. Read from `/proc` (this network namespace's sockets).
pub fn wildcard_listeners(groups: &[u32]) -> Vec<String> {
    let wildcard: HashMap<String, u16> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|t| wildcard_inodes(&std::fs::read_to_string(t).unwrap_or_default()))
        .collect();
    let mut found = Vec::new();
    if wildcard.is_empty() {
        return found;
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Some((name, pgrp)) = name_and_group(&entry.path()) else {
            continue;
        };
        if !groups.contains(&pgrp) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let target = target.to_string_lossy();
            if let Some(port) = target
                .strip_prefix("socket:[")
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|inode| wildcard.get(inode))
            {
                found.push(format!("{name}[{pid}] port {port}"));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// Socket inode → port of every socket listening on 0.0.0.0 or :: in a `/proc/net/tcp`
/// or `tcp6` table.
fn wildcard_inodes(table: &str) -> HashMap<String, u16> {
    let mut found = HashMap::new();
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
            continue;
        };
        let Some((addr, port)) = local.split_once(':') else {
            continue;
        };
        // 0A: TCP_LISTEN.
        if *state == "0A" && addr.bytes().all(|b| b == b'0') {
            found.insert(
                inode.to_string(),
                u16::from_str_radix(port, 16).unwrap_or(0),
            );
        }
    }
    found
}

/// A process's name and process group, from `<proc dir>/stat`.
fn name_and_group(proc_dir: &Path) -> Option<(String, u32)> {
    let stat = std::fs::read_to_string(proc_dir.join("stat")).ok()?;
    // `pid (comm) state ppid pgrp …`: the comm may hold spaces and parentheses.
    let (head, rest) = stat.rsplit_once(')')?;
    let pgrp = rest.split_whitespace().nth(2)?.parse().ok()?;
    Some((head.split_once('(')?.1.to_string(), pgrp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_on_every_address_are_told_from_the_rest() {
        // Lines of /proc/net/tcp and tcp6 as the kernel writes them.
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:7344 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0000000000000000 100 0 0 10 0
   1: 0100007F:7345 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0000000000000000 100 0 0 10 0
   2: 00000000:7346 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0000000000000000 100 0 0 10 0";
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0000000000000000 100 0 0 10 0";
        let mut found = wildcard_inodes(tcp);
        found.extend(wildcard_inodes(tcp6));
        let want: HashMap<String, u16> = [("111".into(), 0x7344), ("444".into(), 0x1f90)].into();
        assert_eq!(
            found, want,
            "listening on 0.0.0.0 and ::, not on loopback, not connected"
        );
    }

    #[test]
    fn this_process_is_found_in_its_group() {
        let (name, group) = name_and_group(Path::new("/proc/self")).unwrap();
        assert!(!name.is_empty());
        // A listener on loopback is never reported.
        let lo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = lo.local_addr().unwrap().port();
        assert!(!wildcard_listeners(&[group])
            .iter()
            .any(|s| s.ends_with(&format!(" port {port}"))));
    }
}
