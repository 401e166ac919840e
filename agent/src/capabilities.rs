//! The Linux capabilities the agent needs, and naming the ones it lacks when the kernel
//! refuses something, so the error says what to grant.
//!
//! [`NODE_AGENT`] is the one list: the node agent's DaemonSet adds exactly these
//! (`deploy/kubernetes/base/agent.yaml`, checked by `e2e/tests/e2e/deploy_manifests.rs`), and
//! `e2e/tests/e2e/least_privilege.rs` runs the real agent as a non-root user holding
//! exactly these, then without each in turn.

/// What the NIXL probes need, in Kubernetes' spelling (`CAP_` left off): `SYS_ADMIN` to
/// load the programs (it grants what `BPF` and `PERFMON` would) and to open uprobe perf
/// events — the kernel CI runs on (6.18) refuses those to `BPF` + `PERFMON` alone
/// (measured: `perf_event_open` answers EACCES) — and `SYS_PTRACE` to read other users'
/// processes' `/proc/<pid>/maps` and open their `libnixl.so` through
/// `/proc/<pid>/root`.
pub const NODE_AGENT: &[&str] = &["SYS_ADMIN", "SYS_PTRACE"];

/// Capability numbers (`linux/capability.h`) of the ones named here.
fn number(name: &str) -> Option<u32> {
    Some(match name {
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        "PERFMON" => 38,
        "BPF" => 39,
        _ => return None,
    })
}

/// The effective set, from a `/proc/<pid>/status` text (`CapEff:` in hex).
pub(crate) fn effective_in(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// This process's effective set.
pub fn effective() -> Option<u64> {
    effective_in(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// Of `needed`, the ones not in `effective` (as `CAP_X`). `SYS_ADMIN` stands in for
/// `BPF` and `PERFMON`, as the kernel lets it.
pub(crate) fn lacking(effective: u64, needed: &[&str]) -> Vec<String> {
    let has = |name: &str| number(name).is_some_and(|n| effective & (1 << n) != 0);
    needed
        .iter()
        .filter(|n| !(has(n) || (matches!(**n, "BPF" | "PERFMON") && has("SYS_ADMIN"))))
        .map(|n| format!("CAP_{n}"))
        .collect()
}

/// Why loading BPF programs was refused: `BPF` and `PERFMON`, which `SYS_ADMIN` grants.
pub(crate) fn diagnose_load() -> String {
    let d = diagnose(&["BPF", "PERFMON"]);
    if d.starts_with("the agent lacks") {
        format!("{d} (CAP_SYS_ADMIN grants both)")
    } else {
        d
    }
}

/// Why opening a uprobe perf event was refused: `SYS_ADMIN` on kernels like CI's,
/// `PERFMON` on those that open uprobes to it.
pub(crate) fn diagnose_attach() -> String {
    let d = diagnose(&["SYS_ADMIN"]);
    if d.starts_with("the agent lacks") {
        format!("{d}: this kernel opens uprobe perf events only with it")
    } else {
        d
    }
}

/// A sentence for an error: which of `needed` this process lacks, or that it has them
/// all (the refusal then came from elsewhere: an LSM, a seccomp profile, a sysctl).
pub(crate) fn diagnose(needed: &[&str]) -> String {
    match effective() {
        None => "its capabilities could not be read".to_string(),
        Some(eff) => {
            let missing = lacking(eff, needed);
            if missing.is_empty() {
                format!(
                    "it holds {} (so something else refused: an LSM, seccomp, a sysctl)",
                    needed
                        .iter()
                        .map(|n| format!("CAP_{n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                format!("the agent lacks {}", missing.join(" and "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_set_is_read_and_missing_ones_named() {
        let status = "Name:\tkvscope\nCapInh:\t0000000000000000\nCapEff:\t000000c000080000\n";
        let eff = effective_in(status).unwrap();
        assert_eq!(eff, (1 << 39) | (1 << 38) | (1 << 19));
        let node = ["BPF", "PERFMON", "SYS_PTRACE"];
        assert!(lacking(eff, &node).is_empty());
        assert_eq!(lacking(eff & !(1 << 38), &node), vec!["CAP_PERFMON"]);
        assert_eq!(
            lacking(0, &node),
            vec!["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE"]
        );
        assert_eq!(lacking(eff, NODE_AGENT), vec!["CAP_SYS_ADMIN"]);
        assert_eq!(lacking(1 << 21, &["BPF", "PERFMON"]), Vec::<String>::new());
        assert_eq!(effective_in("CapEff:\tzz\n"), None);
        assert!(effective().is_some(), "this process's own set reads");
    }
}
