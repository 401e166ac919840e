//! Finding the `libnixl.so` files processes have mapped, by scanning `/proc/*/maps`.
//!
//! A library is identified by (device, inode): uprobes are tied to the inode, so one
//! attachment covers every process mapping that file, and a process restarted from it
//! is covered again. Copies in other venvs or containers are distinct files found here.
//! Paths are opened through `/proc/<pid>/root` so a container's file is the one probed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// File name the scan looks for.
pub(crate) const LIBNIXL: &str = "libnixl.so";

/// One library file and the processes mapping it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedLibrary {
    /// A path that opens the mapped file from this (the agent's) mount namespace.
    pub path: PathBuf,
    pub pids: BTreeSet<u32>,
}

/// (device as in /proc/pid/maps, inode)
pub(crate) type FileId = (String, u64);

/// Parse one `/proc/<pid>/maps` line: the (device, inode) and path of a mapped
/// `libnixl.so`, or None.
pub(crate) fn parse_maps_line(line: &str) -> Option<(FileId, &str)> {
    let mut fields = line.split_whitespace();
    let _range = fields.next()?;
    let _perms = fields.next()?;
    let _offset = fields.next()?;
    let dev = fields.next()?;
    let inode: u64 = fields.next()?.parse().ok()?;
    let path = fields.next()?;
    let is_lib = Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == LIBNIXL || n.starts_with("libnixl.so."));
    (is_lib && inode != 0).then_some(((dev.to_string(), inode), path))
}

/// What a scan found.
#[derive(Debug, Default)]
pub struct Scan {
    pub libraries: BTreeMap<FileId, MappedLibrary>,
    /// Processes whose maps this process may not read (another user's, without
    /// CAP_SYS_PTRACE): not looked into, so not traced.
    pub denied: BTreeSet<u32>,
}

/// Scan every process (or only `only_pid`) for mapped `libnixl.so` files. Processes
/// that vanish mid-scan are skipped; those that may not be read are listed.
pub fn scan(proc_root: &Path, only_pid: Option<u32>) -> Scan {
    let mut found: BTreeMap<FileId, MappedLibrary> = BTreeMap::new();
    let mut denied = BTreeSet::new();
    let pids: Vec<u32> = match only_pid {
        Some(p) => vec![p],
        None => std::fs::read_dir(proc_root)
            .map(|rd| {
                rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default(),
    };
    for pid in pids {
        let maps = match std::fs::read_to_string(proc_root.join(pid.to_string()).join("maps")) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                denied.insert(pid);
                continue;
            }
            Err(_) => continue,
        };
        for line in maps.lines() {
            if let Some((id, path)) = parse_maps_line(line) {
                let entry = found.entry(id).or_insert_with(|| MappedLibrary {
                    path: proc_root
                        .join(pid.to_string())
                        .join("root")
                        .join(path.trim_start_matches('/')),
                    pids: BTreeSet::new(),
                });
                entry.pids.insert(pid);
            }
        }
    }
    Scan {
        libraries: found,
        denied,
    }
}

/// The (device, inode) of a file on disk, in the `/proc/pid/maps` device notation
/// (`major:minor` in hex), so a configured path and a mapped one compare equal.
pub(crate) fn file_id(path: &Path) -> std::io::Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    let dev = m.dev();
    // glibc's encoding of dev_t.
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    Ok((format!("{major:02x}:{minor:02x}"), m.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines() {
        let l = "7f1c2a000000-7f1c2a05e000 r--p 00000000 fd:01 1234567   /opt/venv/lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs/libnixl.so";
        let (id, path) = parse_maps_line(l).unwrap();
        assert_eq!(id, ("fd:01".to_string(), 1234567));
        assert!(path.ends_with("/libnixl.so"));
        assert!(parse_maps_line("7f-7f r--p 0 fd:01 99 /usr/lib/libnixl_capi.so").is_none());
        assert!(parse_maps_line("7f-7f rw-p 0 00:00 0 ").is_none());
        assert!(parse_maps_line("garbage").is_none());
        assert!(parse_maps_line("7f-7f r--p 0 fd:01 5 /x/libnixl.so.1").is_some());
    }

    #[test]
    fn the_scan_finds_this_process_libraries_through_its_root() {
        // Our own maps hold no libnixl.so; a fake /proc with one does.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("4242");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(
            p.join("maps"),
            "7f-7f r-xp 0 fd:01 77 /venv/libs/libnixl.so\n7f-7f r--p 0 fd:01 77 /venv/libs/libnixl.so\n",
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("self-not-a-pid")).unwrap();
        let found = scan(dir.path(), None).libraries;
        assert_eq!(found.len(), 1);
        let lib = &found[&("fd:01".to_string(), 77)];
        assert_eq!(lib.pids.iter().copied().collect::<Vec<_>>(), vec![4242]);
        assert_eq!(lib.path, dir.path().join("4242/root/venv/libs/libnixl.so"));
        assert!(
            scan(dir.path(), Some(1)).libraries.is_empty(),
            "a pid that does not exist"
        );
    }

    #[test]
    fn a_file_id_matches_the_maps_notation_of_this_binary() {
        let exe = std::env::current_exe().unwrap();
        let id = file_id(&exe).unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let exe_s = exe.to_string_lossy();
        let line = maps
            .lines()
            .find(|l| l.ends_with(&*exe_s))
            .expect("our own exe is mapped");
        let mut f = line.split_whitespace().skip(3);
        assert_eq!(
            (f.next().unwrap(), f.next().unwrap().parse::<u64>().unwrap()),
            (id.0.as_str(), id.1)
        );
    }
}
