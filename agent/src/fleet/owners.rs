//! Which Dynamo worker a local process works for, told from the processes rather than
//! typed into a table: a vLLM engine (its NIXL agent, its KV event publisher) lives in
//! the engine process, a child of the Dynamo worker process that serves the worker's
//! request plane (with one engine process per dp rank). So a process belongs to the
//! worker whose endpoint is served by the process itself or the nearest of its
//! ancestors; failing that (containers of one pod do not share a process tree), to the
//! one worker served from the same Kubernetes pod. Anything else — no such worker, or
//! two at the same distance — is reported as not told, with the reason; nothing is
//! guessed. Used for each local NIXL agent ([`Owners`]) and for each engine KV
//! publisher given without its worker id (`kvscope_agent::fleet::resolve_endpoint`).

use kvscope_discovery::procfs::{self, host_port, listeners, SocketInfo};
use kvscope_discovery::{Channel, Fleet};
use kvscope_wire::nixl::NixlAgentOwner;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Agents not told are looked at again after this long (reading every process's
/// sockets is not free on a busy node).
const RETRY_UNTOLD: Duration = Duration::from_secs(10);

/// Per worker, the processes serving it (its request plane, its KV publishers), and per
/// dp rank the processes binding that rank's publisher.
struct Served {
    by_worker: BTreeMap<u64, BTreeSet<u32>>,
    by_rank: BTreeMap<(u64, u32), BTreeSet<u32>>,
}

fn served(fleet: &Fleet, sockets: &[SocketInfo]) -> Served {
    let mut s = Served {
        by_worker: BTreeMap::new(),
        by_rank: BTreeMap::new(),
    };
    for w in fleet.workers.values() {
        let pids = s.by_worker.entry(w.instance_id).or_default();
        if let Some((h, p)) = w.request_plane.as_deref().and_then(host_port) {
            pids.extend(listeners(sockets, h, p));
        }
    }
    for p in fleet.kv_publishers.values() {
        let Some(Channel::Zmq { endpoint }) = &p.channel else {
            continue;
        };
        let Some((h, port)) = host_port(endpoint) else {
            continue;
        };
        let pids = listeners(sockets, h, port);
        if let Some(w) = s.by_worker.get_mut(&p.worker.worker_id) {
            w.extend(pids.iter().copied());
        }
        s.by_rank
            .entry((p.worker.worker_id, p.worker.dp_rank))
            .or_default()
            .extend(pids);
    }
    s
}

/// The worker process `pid` works for, as told from the process tree and the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProcessOwner {
    pub worker_id: Option<u64>,
    /// The dp rank, when the worker has several and exactly one rank's publisher is in
    /// the process's tree.
    pub dp_rank: Option<u32>,
    /// Not told because several workers are served at the same distance (only a
    /// mapping given by hand can say which).
    pub ambiguous: bool,
    /// How it was told, or why not.
    pub how: String,
}

/// Tell the worker process `pid` works for (see the module's text).
pub(crate) fn worker_of_process(
    fleet: &Fleet,
    sockets: &[SocketInfo],
    proc_root: &Path,
    pid: u32,
) -> ProcessOwner {
    if fleet.workers.is_empty() {
        return ProcessOwner {
            worker_id: None,
            dp_rank: None,
            ambiguous: false,
            how: "no workers in Dynamo's discovery store yet".into(),
        };
    }
    let served = served(fleet, sockets);
    let chain = procfs::ancestry(proc_root, pid);
    let depth_in_chain = |pids: &BTreeSet<u32>| chain.iter().position(|p| pids.contains(p));
    let by_depth: Vec<(usize, u64)> = served
        .by_worker
        .iter()
        .filter_map(|(&w, pids)| Some((depth_in_chain(pids)?, w)))
        .collect();
    let mut ambiguous = false;
    let (worker, how) = if let Some(&(best, _)) = by_depth.iter().min() {
        let at_best: Vec<u64> = by_depth
            .iter()
            .filter(|(d, _)| *d == best)
            .map(|(_, w)| *w)
            .collect();
        let how = match best {
            0 => "same process".to_string(),
            1 => format!("parent process {}", chain[1]),
            _ => format!("ancestor process {}", chain[best]),
        };
        match at_best[..] {
            [w] => (Some(w), how),
            _ => {
                ambiguous = true;
                (None, format!("{how} serves several workers ({at_best:?})"))
            }
        }
    } else if let Some(pod) = procfs::pod_of(proc_root, pid) {
        let in_pod: Vec<u64> = served
            .by_worker
            .iter()
            .filter(|(_, pids)| {
                pids.iter()
                    .any(|&p| procfs::pod_of(proc_root, p).as_deref() == Some(pod.as_str()))
            })
            .map(|(&w, _)| w)
            .collect();
        match in_pod[..] {
            [w] => (Some(w), format!("same pod {pod}")),
            [] => (None, format!("no worker is served from its pod {pod}")),
            _ => {
                ambiguous = true;
                (
                    None,
                    format!("pod {pod} serves several workers ({in_pod:?})"),
                )
            }
        }
    } else {
        (
            None,
            "no worker's request plane or KV publisher is served by its process, its ancestors or its pod"
                .to_string(),
        )
    };
    let mut dp_rank = None;
    if let Some(w) = worker {
        let ranks: Vec<u32> = served
            .by_rank
            .iter()
            .filter(|((id, _), pids)| *id == w && depth_in_chain(pids).is_some())
            .map(|((_, r), _)| *r)
            .collect();
        let many = fleet.workers.get(&w).is_some_and(|w| w.dp_ranks.len() > 1);
        if let ([r], true) = (&ranks[..], many) {
            dp_rank = Some(*r);
        }
    }
    ProcessOwner {
        worker_id: worker,
        dp_rank,
        ambiguous,
        how,
    }
}

/// Tell the worker of the NIXL agent `agent` held by process `pid`.
pub fn tell(
    fleet: &Fleet,
    sockets: &[SocketInfo],
    proc_root: &Path,
    pid: u32,
    agent: &str,
) -> NixlAgentOwner {
    let o = worker_of_process(fleet, sockets, proc_root, pid);
    NixlAgentOwner {
        agent: agent.to_string(),
        pid,
        worker_id: o.worker_id,
        dp_rank: o.dp_rank,
        how: if o.ambiguous {
            format!("{}; map it in the actuator's [[worker_agents]]", o.how)
        } else {
            o.how
        },
    }
}

/// The owners told so far, re-told when the fleet changes and, for agents not told, at
/// most every [`RETRY_UNTOLD`].
#[derive(Default)]
pub(crate) struct Owners {
    fleet: Option<Arc<Fleet>>,
    told: BTreeMap<(u32, String), (NixlAgentOwner, Instant)>,
}

impl Owners {
    /// The owners of `agents` (pid, name) as of `fleet`, read under `proc_root`.
    pub fn update(
        &mut self,
        fleet: &Arc<Fleet>,
        agents: &BTreeSet<(u32, String)>,
        proc_root: &Path,
    ) -> Vec<NixlAgentOwner> {
        let now = Instant::now();
        if !self.fleet.as_ref().is_some_and(|f| Arc::ptr_eq(f, fleet)) {
            self.told.clear();
            self.fleet = Some(fleet.clone());
        }
        self.told.retain(|k, _| agents.contains(k));
        let stale =
            |k: &(u32, String), told: &BTreeMap<(u32, String), (NixlAgentOwner, Instant)>| {
                told.get(k).is_none_or(|(o, at)| {
                    o.worker_id.is_none() && now.duration_since(*at) >= RETRY_UNTOLD
                })
            };
        let todo: Vec<&(u32, String)> = agents.iter().filter(|k| stale(k, &self.told)).collect();
        if !todo.is_empty() {
            let sockets = procfs::sockets_of(proc_root, &procfs::all_pids(proc_root));
            for (pid, name) in todo {
                let o = tell(fleet, &sockets, proc_root, *pid, name);
                self.told.insert((*pid, name.clone()), (o, now));
            }
        }
        self.told.values().map(|(o, _)| o.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvscope_discovery::{KvPublisher, Worker};
    use kvscope_wire::hashing::MediaPlaceholders;
    use kvscope_wire::WorkerKey;

    /// A `/proc` with processes (pid, ppid, cgroup, listening sockets as (inode, hex
    /// local address)).
    struct FakeProc(tempfile::TempDir);

    impl FakeProc {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }
        fn process(&self, pid: u32, ppid: u32, cgroup: &str, listens: &[(u64, &str)]) {
            let p = self.0.path().join(pid.to_string());
            std::fs::create_dir_all(p.join("fd")).unwrap();
            std::fs::create_dir_all(p.join("net")).unwrap();
            std::fs::write(p.join("stat"), format!("{pid} (p) S {ppid} 1 1 0")).unwrap();
            std::fs::write(p.join("comm"), "p\n").unwrap();
            std::fs::write(p.join("cgroup"), format!("0::{cgroup}\n")).unwrap();
            let mut tcp = String::from("  sl  local_address rem_address   st\n");
            for (i, (inode, local)) in listens.iter().enumerate() {
                tcp.push_str(&format!(
                    "   {i}: {local} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 {inode} 1\n"
                ));
                std::os::unix::fs::symlink(
                    format!("socket:[{inode}]"),
                    p.join(format!("fd/{}", 10 + i)),
                )
                .unwrap();
            }
            std::fs::write(p.join("net/tcp"), tcp).unwrap();
        }
        fn root(&self) -> &Path {
            self.0.path()
        }
    }

    fn worker(id: u64, request_plane: &str, dp_ranks: Vec<u32>) -> Worker {
        Worker {
            instance_id: id,
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "generate".into(),
            request_plane: Some(request_plane.into()),
            model: Some("m".into()),
            block_size: Some(16),
            total_kv_blocks: None,
            dp_ranks,
            worker_type: None,
            model_config: None,
        }
    }

    fn publisher(id: u64, worker_id: u64, dp_rank: u32, endpoint: &str) -> (u64, KvPublisher) {
        (
            id,
            KvPublisher {
                publisher_id: id,
                worker: WorkerKey { worker_id, dp_rank },
                channel: Some(Channel::Zmq {
                    endpoint: endpoint.into(),
                }),
                recovery: None,
            },
        )
    }

    fn tell_all(fleet: &Fleet, proc: &FakeProc, pids: &[u32]) -> Vec<NixlAgentOwner> {
        let sockets = procfs::sockets_of(proc.root(), &procfs::all_pids(proc.root()));
        pids.iter()
            .map(|&p| tell(fleet, &sockets, proc.root(), p, &format!("agent-{p}")))
            .collect()
    }

    #[test]
    fn an_engine_child_belongs_to_the_worker_its_parent_serves() {
        let proc = FakeProc::new();
        // Worker 7: Dynamo process 100 serves 127.0.0.1:9000 (0x2328); engine 101 binds
        // its KV publisher on 5557 (0x15B5); NIXL agents in 102 (a grandchild) and 101.
        proc.process(1, 0, "/", &[]);
        proc.process(100, 1, "/", &[(1, "0100007F:2328")]);
        proc.process(101, 100, "/", &[(2, "00000000:15B5")]);
        proc.process(102, 101, "/", &[]);
        // Worker 8 in 200, the same shape, request plane on every address, port 9001.
        proc.process(200, 1, "/", &[(3, "00000000:2329")]);
        proc.process(201, 200, "/", &[]);
        // A NIXL process under no worker.
        proc.process(300, 1, "/", &[]);
        let fleet = Fleet {
            workers: BTreeMap::from([
                (
                    7,
                    worker(7, "127.0.0.1:9000/7/dynamo/backend/generate", vec![0]),
                ),
                (
                    8,
                    worker(8, "127.0.0.1:9001/8/dynamo/backend/generate", vec![0]),
                ),
            ]),
            kv_publishers: BTreeMap::from([publisher(1, 7, 0, "tcp://127.0.0.1:5557")]),
        };
        let o = tell_all(&fleet, &proc, &[102, 101, 201, 300, 100]);
        assert_eq!(o[0].worker_id, Some(7));
        assert_eq!(
            o[0].how, "parent process 101",
            "the publisher's process is nearest"
        );
        assert_eq!(o[1].how, "same process");
        assert_eq!(
            (o[2].worker_id, o[2].how.as_str()),
            (Some(8), "parent process 200")
        );
        assert_eq!(o[3].worker_id, None);
        assert!(
            o[3].how.starts_with("no worker's request plane"),
            "{}",
            o[3].how
        );
        assert_eq!(o[4].worker_id, Some(7));
        assert!(
            o.iter().all(|o| o.dp_rank.is_none()),
            "one rank each: not named"
        );
    }

    /// A vLLM-format publisher that discovery does not list, bound by an engine process
    /// under the worker's process: `--kv ENDPOINT` without an id finds that worker.
    #[test]
    fn an_engine_publisher_given_without_its_id_is_told_from_its_parent() {
        let proc = FakeProc::new();
        proc.process(1, 0, "/", &[]);
        // Worker 7's process 100 serves 9000; its engine 101 publishes on 5600 (0x15E0).
        proc.process(100, 1, "/", &[(1, "0100007F:2328")]);
        proc.process(101, 100, "/", &[(2, "0100007F:15E0")]);
        // A publisher under no worker, on 5601.
        proc.process(300, 1, "/", &[(3, "0100007F:15E1")]);
        let fleet = Fleet {
            workers: BTreeMap::from([(
                7,
                worker(7, "127.0.0.1:9000/7/dynamo/backend/generate", vec![0]),
            )]),
            kv_publishers: BTreeMap::new(),
        };
        let resolve = |ep: &str| crate::fleet::resolve_endpoint(&fleet, ep, proc.root());
        assert_eq!(resolve("tcp://127.0.0.1:5600"), Ok((7, 101)));
        let e = resolve("tcp://127.0.0.1:5601").unwrap_err();
        assert!(
            e.contains("process 300") && e.contains("no worker's"),
            "{e}"
        );
        let e = resolve("tcp://127.0.0.1:5602").unwrap_err();
        assert!(e.contains("no local process listens"), "{e}");
    }

    /// The placeholders of a worker's model, from the config.json its card names, read
    /// through the publisher process's root (its own file system); why not, where not.
    #[test]
    fn a_models_placeholders_come_from_its_config_through_the_process_root() {
        let proc = FakeProc::new();
        proc.process(101, 1, "/", &[]);
        let dir = proc.root().join("101/root/models/vl");
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = worker(7, "127.0.0.1:9000/7/x", vec![0]);
        w.model_config = Some("/models/vl/config.json".into());
        let fleet = Fleet {
            workers: BTreeMap::from([(7, w)]),
            kv_publishers: BTreeMap::new(),
        };
        let read = || crate::fleet::media_placeholders(&fleet, 7, 101, proc.root());
        let e = read().unwrap_err();
        assert!(e.contains("101/root/models/vl/config.json"), "{e}");
        let write = |json: &str| std::fs::write(dir.join("config.json"), json).unwrap();
        write(r#"{"model_type":"qwen2_vl","image_token_id":151655,"video_token_id":151656}"#);
        assert_eq!(
            read(),
            Ok(MediaPlaceholders {
                image: Some(151655),
                video: Some(151656)
            })
        );
        write(r#"{"model_type":"x","video_token_index":32001}"#);
        assert_eq!(
            read(),
            Ok(MediaPlaceholders {
                image: None,
                video: Some(32001)
            })
        );
        write(r#"{"model_type":"llama"}"#);
        assert!(read().unwrap_err().contains("names no image_token_id"));
        write("not json");
        assert!(read().is_err());
        // A FIFO where the config should be: refused at once, never waited on.
        std::fs::remove_file(dir.join("config.json")).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(dir.join("config.json"))
            .status()
            .unwrap();
        assert!(made.success());
        let e = read().unwrap_err();
        assert!(e.contains("is not a file"), "{e}");
        let e = crate::fleet::media_placeholders(&fleet, 8, 101, proc.root()).unwrap_err();
        assert!(e.contains("names no config.json"), "{e}");
    }

    #[test]
    fn a_request_plane_on_another_address_is_not_this_worker() {
        let proc = FakeProc::new();
        // Listens on 10.0.0.5:9000 (0x0500000A), the worker says 10.0.0.6:9000.
        proc.process(100, 1, "/", &[(1, "0500000A:2328")]);
        let fleet = Fleet {
            workers: BTreeMap::from([(7, worker(7, "10.0.0.6:9000/7/x", vec![0]))]),
            kv_publishers: BTreeMap::new(),
        };
        assert_eq!(tell_all(&fleet, &proc, &[100])[0].worker_id, None);
    }

    #[test]
    fn two_workers_in_one_tree_and_dp_ranks() {
        let proc = FakeProc::new();
        // One process serves workers 7 and 8: its child cannot be told.
        proc.process(100, 1, "/", &[(1, "0100007F:2328"), (2, "0100007F:2329")]);
        proc.process(101, 100, "/", &[]);
        // Worker 9 runs two dp ranks, one engine process each (publishers 5558, 5559).
        proc.process(200, 1, "/", &[(3, "0100007F:232A")]);
        proc.process(201, 200, "/", &[(4, "0100007F:15B6")]);
        proc.process(202, 200, "/", &[(5, "0100007F:15B7")]);
        proc.process(203, 202, "/", &[]);
        let fleet = Fleet {
            workers: BTreeMap::from([
                (7, worker(7, "127.0.0.1:9000/7/x", vec![0])),
                (8, worker(8, "127.0.0.1:9001/8/x", vec![0])),
                (9, worker(9, "127.0.0.1:9002/9/x", vec![0, 1])),
            ]),
            kv_publishers: BTreeMap::from([
                publisher(1, 9, 0, "tcp://127.0.0.1:5558"),
                publisher(2, 9, 1, "tcp://127.0.0.1:5559"),
            ]),
        };
        let o = tell_all(&fleet, &proc, &[101, 203, 201, 200]);
        assert_eq!(o[0].worker_id, None);
        assert!(
            o[0].how.contains("several workers ([7, 8])"),
            "{}",
            o[0].how
        );
        assert_eq!((o[1].worker_id, o[1].dp_rank), (Some(9), Some(1)));
        assert_eq!((o[2].worker_id, o[2].dp_rank), (Some(9), Some(0)));
        assert_eq!(
            (o[3].worker_id, o[3].dp_rank),
            (Some(9), None),
            "both ranks under it"
        );
    }

    #[test]
    fn containers_of_one_pod_share_it_without_a_process_tree() {
        let proc = FakeProc::new();
        let pod = |uid: &str, c: &str| {
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{c}.scope")
        };
        proc.process(100, 1, &pod("aa", "1"), &[(1, "00000000:2328")]);
        proc.process(150, 1, &pod("aa", "2"), &[]); // a sidecar container's NIXL agent
        proc.process(200, 1, &pod("bb", "1"), &[(2, "00000000:2329")]);
        proc.process(250, 1, &pod("cc", "1"), &[]);
        let fleet = Fleet {
            workers: BTreeMap::from([
                (7, worker(7, "10.1.0.1:9000/7/x", vec![0])),
                (8, worker(8, "10.1.0.2:9001/8/x", vec![0])),
            ]),
            kv_publishers: BTreeMap::new(),
        };
        let o = tell_all(&fleet, &proc, &[150, 250]);
        assert_eq!(
            (o[0].worker_id, o[0].how.as_str()),
            (Some(7), "same pod aa")
        );
        assert_eq!(o[1].worker_id, None);
        assert_eq!(o[1].how, "no worker is served from its pod cc");
    }

    #[test]
    fn owners_are_kept_until_the_fleet_or_the_agents_change() {
        let proc = FakeProc::new();
        proc.process(100, 1, "/", &[(1, "0100007F:2328")]);
        proc.process(101, 100, "/", &[]);
        let fleet = Arc::new(Fleet {
            workers: BTreeMap::from([(7, worker(7, "127.0.0.1:9000/7/x", vec![0]))]),
            kv_publishers: BTreeMap::new(),
        });
        let mut owners = Owners::default();
        let agents = BTreeSet::from([(101, "a".to_string())]);
        assert_eq!(
            owners.update(&fleet, &agents, proc.root())[0].worker_id,
            Some(7)
        );
        // The process tree changes under a kept answer: kept (same fleet, same agent).
        std::fs::remove_dir_all(proc.root().join("100")).unwrap();
        assert_eq!(
            owners.update(&fleet, &agents, proc.root())[0].worker_id,
            Some(7)
        );
        // A new read of the store: told again.
        let fleet = Arc::new((*fleet).clone());
        assert_eq!(
            owners.update(&fleet, &agents, proc.root())[0].worker_id,
            None
        );
        assert!(owners
            .update(&fleet, &BTreeSet::new(), proc.root())
            .is_empty());
    }
}
