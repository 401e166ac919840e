//! Discovery stores behind TLS: Dynamo's `kubernetes` backend (the API server) and etcd
//! with mutual TLS.
//!
//! Kubernetes. No Kubernetes API server can run here, so this is a test of kvscope's own reading:
//! a small HTTPS server (Python's `http.server` behind `ssl`, with a CA made for the
//! test) answers the two lists a real API server would, only to the service account's
//! bearer token, with the lab's real Dynamo 1.6.1 store (`lab/fixtures/samples/
//! discovery`) cut into one `DynamoWorkerMetadata` object per worker pod, the shape
//! Dynamo's own kubernetes backend writes. Asserts: the fleet read this way equals the
//! one the file backend reads from the same documents, for the ready pods only; a pod
//! that becomes ready appears at the next read; a refused token and a server the CA
//! did not sign are errors that say so. What is not checked here: that a real API
//! server and Dynamo's operator produce exactly these objects.

use kvscope_discovery::backend::{read_file_store, Backend};
use kvscope_discovery::config::{BackendKind, DiscoveryConfig};
use kvscope_discovery::Fleet;
use kvscope_lab::bus_security::LoopbackCa;
use kvscope_lab::process::{ManagedProcess, StopOnDrop};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "sa-token-for-kvscope";

/// Answers `GET` with `<dir>/<name>.json` for the two lists, 401 to any other token.
const SERVER: &str = r#"
import http.server, ssl, sys, json, urllib.parse, os
port, cert, key, token, root = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer " + token:
            return self.reply(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
        u = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(u.query)
        if u.path == "/apis/discovery.k8s.io/v1/namespaces/dynamo/endpointslices" and q.get("labelSelector") == ["nvidia.com/dynamo-discovery-enabled=true"]:
            return self.reply(200, json.load(open(os.path.join(root, "endpointslices.json"))))
        if u.path == "/apis/nvidia.com/v1alpha1/namespaces/dynamo/dynamoworkermetadatas":
            return self.reply(200, json.load(open(os.path.join(root, "dwm.json"))))
        self.reply(404, {"kind": "Status", "code": 404, "message": "not found: " + self.path})
    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
s = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
s.socket = ctx.wrap_socket(s.socket, server_side=True)
print("ready", flush=True)
s.serve_forever()
"#;

/// The lab store's documents, one `DynamoWorkerMetadata` per worker (pod
/// `worker-<instance hex>`): a worker's endpoints and model card end with its instance
/// id; its event channels and sources end with its publisher id, which its
/// `worker_kv_query_source_<publisher>/<instance>` endpoint ties to it.
fn objects_per_pod(store: &[(String, Value)]) -> BTreeMap<String, Map<String, Value>> {
    let last = |k: &str| k.rsplit('/').next().unwrap().to_string();
    let mut publisher_of: BTreeMap<String, String> = BTreeMap::new();
    for (k, _) in store {
        if let Some(rest) = k.split("worker_kv_query_source_").nth(1) {
            let (publisher, instance) = rest.split_once('/').unwrap();
            publisher_of.insert(publisher.to_string(), instance.to_string());
        }
    }
    let instances: Vec<String> = store
        .iter()
        .filter(|(k, _)| k.starts_with("v1/mdc/"))
        .map(|(k, _)| last(k))
        .collect();
    let mut pods: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for (k, doc) in store {
        let (bucket, key) = k.strip_prefix("v1/").unwrap().split_once('/').unwrap();
        let map = match bucket {
            "instances" => "endpoints",
            "mdc" => "model_cards",
            "event_channels" => "event_channels",
            "event_sources" => "event_sources",
            other => panic!("unknown bucket {other}"),
        };
        let id = last(k);
        let owner = if bucket.starts_with("event_") {
            // Channels of other topics belong to no worker here: the first pod's.
            publisher_of
                .get(&id)
                .cloned()
                .unwrap_or(instances[0].clone())
        } else {
            id
        };
        let data = pods.entry(format!("worker-{owner}")).or_default();
        data.entry(map)
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .unwrap()
            .insert(key.to_string(), doc.clone());
    }
    pods
}

fn write_state(dir: &Path, pods: &BTreeMap<String, Map<String, Value>>, ready: &[&str]) {
    let items: Vec<Value> = pods
        .iter()
        .map(|(pod, data)| {
            json!({
                "apiVersion": "nvidia.com/v1alpha1",
                "kind": "DynamoWorkerMetadata",
                "metadata": {"name": pod, "namespace": "dynamo",
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": "u"}]},
                "spec": {"data": data},
            })
        })
        .collect();
    let endpoints: Vec<Value> = pods
        .keys()
        .map(|pod| {
            json!({"addresses": ["10.0.0.1"], "conditions": {"ready": ready.contains(&pod.as_str())},
                   "targetRef": {"kind": "Pod", "name": pod, "namespace": "dynamo"}})
        })
        .collect();
    std::fs::write(
        dir.join("dwm.json"),
        serde_json::to_vec(&json!({"kind": "DynamoWorkerMetadataList", "items": items})).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("endpointslices.json"),
        serde_json::to_vec(
            &json!({"kind": "EndpointSliceList", "items": [{"endpoints": endpoints}]}),
        )
        .unwrap(),
    )
    .unwrap();
}

fn start_server(dir: &Path, ca: &LoopbackCa) -> (StopOnDrop, String) {
    let port = kvscope_lab::ports::pick_ports(1).unwrap()[0];
    let mut cmd = Command::new("python3");
    cmd.args(["-c", SERVER, &port.to_string()])
        .arg(&ca.server_cert)
        .arg(&ca.server_key)
        .arg(TOKEN)
        .arg(dir);
    let log = dir.join("server.log");
    let server =
        ManagedProcess::spawn("kube-api", cmd, &log).expect("python3 runs the test's API server");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("ready")
    {
        assert!(
            Instant::now() < deadline,
            "the test's API server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (
        StopOnDrop(vec![server]),
        format!("https://127.0.0.1:{port}"),
    )
}

fn backend(server: &str, token: &Path, ca: &Path) -> Backend {
    let cfg = DiscoveryConfig {
        backend: BackendKind::Kubernetes,
        kube_server: Some(server.into()),
        kube_namespace: Some("dynamo".into()),
        kube_token_file: Some(token.into()),
        kube_ca_file: Some(ca.into()),
        ..DiscoveryConfig::default()
    };
    cfg.backend().unwrap().unwrap()
}

async fn fleet(b: &Backend) -> Result<Fleet, String> {
    let http = reqwest::Client::new();
    let entries = b.read(&http).await.map_err(|e| e.to_string())?.entries;
    Ok(Fleet::from_entries(
        entries.iter().map(|(k, v)| (k.as_str(), v)),
    ))
}

#[tokio::test]
async fn workers_are_read_from_the_api_server_as_dynamo_registers_them() {
    let dir = tempfile::tempdir().unwrap();
    let ca = LoopbackCa::create(&dir.path().join("tls")).unwrap();
    let store = read_file_store(&PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lab/fixtures/samples/discovery"
    )))
    .unwrap();
    let whole = Fleet::from_entries(store.iter().map(|(k, v)| (k.as_str(), v)));
    assert_eq!(whole.workers.len(), 3);
    let pods = objects_per_pod(&store);
    assert_eq!(pods.len(), 3, "one object per worker pod");
    let names: Vec<&str> = pods.keys().map(String::as_str).collect();

    let state = dir.path().join("api");
    std::fs::create_dir_all(&state).unwrap();
    write_state(&state, &pods, &names[..2]);
    let (_server, url) = start_server(&state, &ca);
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let b = backend(&url, &token, &ca.ca_file);

    // Two pods ready: their workers, exactly as the file backend reads them.
    let two = fleet(&b).await.expect("the API server is read");
    assert_eq!(two.workers.len(), 2);
    for (id, w) in &two.workers {
        assert_eq!(Some(w), whole.workers.get(id));
        assert!(names[..2].contains(&format!("worker-{id:x}").as_str()));
    }
    let publishers_of_two: Vec<_> = whole
        .kv_publishers
        .iter()
        .filter(|(_, p)| two.workers.contains_key(&p.worker.worker_id))
        .collect();
    assert_eq!(
        two.kv_publishers.iter().collect::<Vec<_>>(),
        publishers_of_two
    );
    // The third becomes ready: read at the next poll, and the fleet is whole.
    write_state(&state, &pods, &names);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let f = fleet(&b).await.unwrap();
        if f.workers.len() == 3 {
            assert_eq!(f, whole);
            break;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A token the server refuses, and a server whose certificate another CA signed.
    let bad = dir.path().join("bad-token");
    std::fs::write(&bad, "nope").unwrap();
    let e = fleet(&backend(&url, &bad, &ca.ca_file)).await.unwrap_err();
    assert!(e.contains("401") && e.contains("token was refused"), "{e}");
    let other = LoopbackCa::create(&dir.path().join("other")).unwrap();
    let e = fleet(&backend(&url, &token, &other.ca_file))
        .await
        .unwrap_err();
    assert!(e.contains("GET /apis/discovery.k8s.io"), "{e}");
}

/// etcd with mutual TLS (a real etcd, `--client-cert-auth`), read with Dynamo's own
/// variables (`ETCD_ENDPOINTS=https://…`, `ETCD_AUTH_CA`, `ETCD_AUTH_CLIENT_CERT`,
/// `ETCD_AUTH_CLIENT_KEY`): the same fleet as the file backend reads from the same
/// documents. Without the client certificate, or without the CA, it is an error that
/// says why.
#[tokio::test]
async fn etcd_over_mutual_tls_is_read_with_dynamos_variables() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().unwrap();
    let ca = LoopbackCa::create(&dir.path().join("tls")).unwrap();
    let (cert, key) = ca.client(&dir.path().join("tls"), "kvscope-agent").unwrap();
    let ports = kvscope_lab::ports::pick_ports(2).unwrap();
    let _etcd = StopOnDrop(vec![kvscope_lab::etcd::spawn_with(
        dir.path(),
        ports[0],
        ports[1],
        Some(&ca),
    )
    .unwrap()]);
    let url = format!("https://127.0.0.1:{}", ports[0]);
    // Write the lab's store into it, as Dynamo's workers would (over the same TLS).
    let client =
        kvscope_kit::https::TlsClient::new(&ca.ca_file, Some((cert.as_path(), key.as_path())))
            .unwrap();
    let store = read_file_store(&PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lab/fixtures/samples/discovery"
    )))
    .unwrap();
    let b64 = base64::engine::general_purpose::STANDARD;
    let deadline = Instant::now() + Duration::from_secs(30);
    for (k, v) in &store {
        let body = json!({"key": b64.encode(k), "value": b64.encode(v.to_string())}).to_string();
        loop {
            let put = client
                .request(
                    "POST",
                    &format!("{url}/v3/kv/put"),
                    &[("content-type", "application/json")],
                    Some(body.clone().into_bytes()),
                    Duration::from_secs(5),
                )
                .await;
            match put {
                Ok(a) if a.status == 200 => break,
                other => {
                    assert!(
                        Instant::now() < deadline,
                        "etcd over TLS never took a put: {:?}",
                        other.map(|a| (a.status, String::from_utf8_lossy(&a.body).to_string()))
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
    let env = |with_cert: bool, with_ca: bool| {
        let (url, ca, cert, key) = (url.clone(), ca.ca_file.clone(), cert.clone(), key.clone());
        move |k: &str| -> Option<String> {
            match k {
                "DYN_DISCOVERY_BACKEND" => Some("etcd".into()),
                "ETCD_ENDPOINTS" => Some(url.clone()),
                "ETCD_AUTH_CA" if with_ca => Some(ca.display().to_string()),
                "ETCD_AUTH_CLIENT_CERT" if with_cert => Some(cert.display().to_string()),
                "ETCD_AUTH_CLIENT_KEY" if with_cert => Some(key.display().to_string()),
                _ => None,
            }
        }
    };
    let read = |with_cert: bool, with_ca: bool| {
        let mut cfg = DiscoveryConfig::default();
        cfg.apply_env(env(with_cert, with_ca)).unwrap();
        let b = cfg.backend().unwrap().unwrap();
        async move { fleet(&b).await }
    };
    let whole = Fleet::from_entries(store.iter().map(|(k, v)| (k.as_str(), v)));
    assert_eq!(read(true, true).await.expect("etcd over mutual TLS"), whole);
    let e = read(false, true).await.unwrap_err();
    assert!(e.contains(&url), "{e}");
    let e = read(true, false).await.unwrap_err();
    assert!(e.contains("ETCD_AUTH_CA"), "{e}");
}
