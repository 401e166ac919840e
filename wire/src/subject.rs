//! NATS subject names: `kvscope.<cluster>.<agent>.<kind>[.<worker>]`, all in one
//! JetStream stream per cluster so the collector sees one total order.
//!
//! Records of a known model travel under `kvscope.<cluster>.<agent>.m.<model>.<kind>…`
//! (KV events and decisions by their worker's model, worker records by theirs), and the
//! agents' heartbeats and NIXL reports go there once more for each model they know: so
//! a collector limited to one model consumes only `kvscope.<cluster>.*.m.<model>.>`
//! ([`Subjects::of_model`]) — one filter, one total order, everything its windows need —
//! while a collector of the whole fleet skips those copies ([`Subjects::is_model_copy`]).
//! A record whose model is not known keeps the plain subject.
//!
//! Every subject names the agent that published it, so a server's permissions can let
//! each agent publish under its own name only ([`Subjects::of_agent`]), and the
//! collector can refuse a record whose `agent` is not the one its subject names
//! ([`Subjects::agent_of`]).

use crate::record::Record;

#[derive(Clone, Debug)]
pub struct Subjects {
    cluster: String,
}

impl Subjects {
    /// `cluster` must be a single NATS token; anything else is replaced by `_`.
    pub fn new(cluster: &str) -> Self {
        Self {
            cluster: token(cluster),
        }
    }

    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The stream that holds every subject of the cluster.
    pub fn stream_name(&self) -> String {
        format!("KVSCOPE_{}", self.cluster.to_uppercase())
    }

    /// Wildcard matching every subject of the cluster.
    pub fn all(&self) -> String {
        format!("kvscope.{}.>", self.cluster)
    }

    /// Every subject the agent `agent` publishes: what its NATS user may publish to.
    pub(crate) fn of_agent(&self, agent: &str) -> String {
        format!("kvscope.{}.{}.>", self.cluster, token(agent))
    }

    /// `record`'s subject under `model` (see the module docs).
    pub fn for_record_in_model(&self, agent: &str, record: &Record, model: &str) -> String {
        self.subject(agent, Some(model), record)
    }

    /// Every subject of `model`: what a collector limited to it consumes.
    pub fn of_model(&self, model: &str) -> String {
        format!("kvscope.{}.*.m.{}.>", self.cluster, token(model))
    }

    /// The model token a subject names, if it is a model's subject.
    pub fn model_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject
            .strip_prefix("kvscope.")?
            .strip_prefix(self.cluster.as_str())?
            .strip_prefix('.')?;
        let (_agent, rest) = rest.split_once('.')?;
        let (model, _kind) = rest.strip_prefix("m.")?.split_once('.')?;
        Some(model)
    }

    /// Whether `subject` is a model's copy of a heartbeat or NIXL report (a collector
    /// of the whole fleet has them from their plain subjects).
    pub fn is_model_copy(&self, subject: &str) -> bool {
        self.model_of(subject).is_some()
            && (subject.ends_with(".heartbeat") || subject.ends_with(".nixl"))
    }

    /// The plain subject of `record` (the model not known, or not a model's record).
    pub fn for_record(&self, agent: &str, record: &Record) -> String {
        self.subject(agent, None, record)
    }

    /// `kvscope.<cluster>.<agent>[.m.<model>].<kind>[.<worker>]`.
    fn subject(&self, agent: &str, model: Option<&str>, record: &Record) -> String {
        let (agent, c) = (token(agent), &self.cluster);
        let m = model
            .map(|m| format!("m.{}.", token(m)))
            .unwrap_or_default();
        match record {
            Record::KvEvents(b) => format!("kvscope.{c}.{agent}.{m}kv.{}", b.worker.worker_id),
            Record::Decision(_) => format!("kvscope.{c}.{agent}.{m}decision"),
            Record::Migration(_) => format!("kvscope.{c}.{agent}.{m}migration"),
            Record::Heartbeat(_) => format!("kvscope.{c}.{agent}.{m}heartbeat"),
            Record::Nixl(_) => format!("kvscope.{c}.{agent}.{m}nixl"),
            Record::Worker(_) => format!("kvscope.{c}.{agent}.{m}fleet"),
            Record::RequestEnd(_) => format!("kvscope.{c}.{agent}.{m}request"),
            Record::RouterView(_) => format!("kvscope.{c}.{agent}.{m}view"),
        }
    }

    /// The agent token a subject of this cluster names, or `None` for a subject that is
    /// not one of this cluster's record subjects.
    pub fn agent_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject
            .strip_prefix("kvscope.")?
            .strip_prefix(self.cluster.as_str())?
            .strip_prefix('.')?;
        let (agent, kind) = rest.split_once('.')?;
        (!agent.is_empty() && !kind.is_empty()).then_some(agent)
    }

    /// The scope of a record's subject: `kvscope.<cluster>.<agent>[.m.<model>]`, what a
    /// bundle of records shares (`crate::bundle`); `None` for a subject that is not one
    /// of this cluster's record subjects.
    pub fn scope_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let agent = self.agent_of(subject)?;
        let head = "kvscope.".len() + self.cluster.len() + 1 + agent.len();
        let len = match self.model_of(subject) {
            Some(model) => head + ".m.".len() + model.len(),
            None => head,
        };
        Some(&subject[..len])
    }

    /// The subject of a bundle of records of `scope` (see [`Self::scope_of`]).
    pub fn bundle_subject(scope: &str) -> String {
        format!("{scope}.{}", crate::bundle::BUNDLE_KIND)
    }

    /// Whether a record claiming to come from `agent` may travel on `subject`.
    pub fn subject_matches_agent(&self, subject: &str, agent: &str) -> bool {
        self.agent_of(subject) == Some(token(agent).as_str())
    }

    /// What a server must let the agent `agent` do, and no more: publish its own records,
    /// create or update the cluster's stream (either side may start first), read its own
    /// replies.
    pub fn agent_permissions(&self, agent: &str) -> Permissions {
        let s = self.stream_name();
        Permissions {
            publish: vec![
                self.of_agent(agent),
                format!("$JS.API.STREAM.INFO.{s}"),
                format!("$JS.API.STREAM.CREATE.{s}"),
                format!("$JS.API.STREAM.UPDATE.{s}"),
            ],
            subscribe: vec![format!("{}.>", self.inbox_prefix(agent))],
        }
    }

    /// The key-value bucket holding each collector scope's lease (one key per durable
    /// consumer name: the scope).
    pub fn lease_bucket(&self) -> String {
        format!("{}_LEASES", self.stream_name())
    }

    /// The key of the lease of the collectors with durable consumer `durable`.
    pub fn lease_key(durable: &str) -> String {
        token(durable)
    }

    /// What a server must let the collector with durable consumer `durable` do: open
    /// the stream, read it (its durable consumer, the ordered one of a rebuild, records
    /// fetched by sequence to fill a gap), acknowledge; open or make the lease bucket
    /// and write its own scope's key in it. It publishes no record.
    pub fn collector_permissions(&self, durable: &str) -> Permissions {
        let s = self.stream_name();
        let b = self.lease_bucket();
        Permissions {
            publish: vec![
                format!("$JS.API.STREAM.INFO.KV_{b}"),
                format!("$JS.API.STREAM.CREATE.KV_{b}"),
                format!("$JS.API.STREAM.MSG.GET.KV_{b}"),
                format!("$JS.API.DIRECT.GET.KV_{b}.>"),
                format!("$KV.{b}.{}", Self::lease_key(durable)),
                format!("$JS.API.STREAM.INFO.{s}"),
                format!("$JS.API.STREAM.CREATE.{s}"),
                format!("$JS.API.STREAM.UPDATE.{s}"),
                format!("$JS.API.STREAM.MSG.GET.{s}"),
                format!("$JS.API.DIRECT.GET.{s}"),
                format!("$JS.API.CONSUMER.CREATE.{s}"),
                format!("$JS.API.CONSUMER.CREATE.{s}.>"),
                format!("$JS.API.CONSUMER.DURABLE.CREATE.{s}.>"),
                format!("$JS.API.CONSUMER.INFO.{s}.>"),
                format!("$JS.API.CONSUMER.DELETE.{s}.>"),
                format!("$JS.API.CONSUMER.MSG.NEXT.{s}.>"),
                format!("$JS.ACK.{s}.>"),
            ],
            subscribe: vec![format!("{}.>", self.inbox_prefix(durable))],
        }
    }

    /// Where NATS replies to the process `identity` (an agent id, or a collector's durable
    /// name) go: its own inbox, so that permissions can let it read only its replies.
    pub fn inbox_prefix(&self, identity: &str) -> String {
        format!("_INBOX_kvscope.{}.{}", self.cluster, token(identity))
    }
}

/// Subjects a NATS user may publish to and subscribe to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

impl Permissions {
    /// Both, each list merged and without repeats (one user for several clusters).
    pub fn merge(mut self, other: Permissions) -> Self {
        for (mine, theirs) in [
            (&mut self.publish, other.publish),
            (&mut self.subscribe, other.subscribe),
        ] {
            for s in theirs {
                if !mine.contains(&s) {
                    mine.push(s);
                }
            }
        }
        self
    }

    /// As a user's `permissions` block in a `nats-server` configuration file.
    pub fn to_nats_conf(&self) -> String {
        let list = |v: &[String]| {
            v.iter()
                .map(|s| format!("\"{s}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }}",
            list(&self.publish),
            list(&self.subscribe)
        )
    }
}

/// The stream's default byte limit: 4 GiB. At ~39 bytes per KV block stored or removed
/// (decisions included; `kvscope-bench freshness` at 100k blocks/s) that is ~110M block
/// events, ~55M stores and their removals: the churn of a fleet caching 1,000 × 50k
/// blocks, so a restarted collector still rebuilds a whole mirror; and it fits a NATS
/// server whose JetStream store is 8 GB (the deploy's). Without a byte limit a busy
/// fleet fills the server's store within the age limit (~340 GB a day at 100k blocks/s),
/// and then the server refuses every publish.
pub const DEFAULT_STREAM_MAX_BYTES: u64 = 4 << 30;

/// The stream both the agents and the collector ask for (either may start first):
/// every subject of the cluster, on disk, records kept for `max_age` and at most
/// `max_bytes` bytes in all (0: no byte limit), the oldest discarded first, on
/// `replicas` servers ([`stream_replicas`]).
#[cfg(feature = "jetstream")]
pub fn stream_config(
    subjects: &Subjects,
    max_age: std::time::Duration,
    max_bytes: u64,
    replicas: usize,
) -> async_nats::jetstream::stream::Config {
    async_nats::jetstream::stream::Config {
        num_replicas: replicas.max(1),
        name: subjects.stream_name(),
        subjects: vec![subjects.all()],
        storage: async_nats::jetstream::stream::StorageType::File,
        max_age,
        // NATS says "no limit" with -1.
        max_bytes: i64::try_from(max_bytes)
            .ok()
            .filter(|&b| b > 0)
            .unwrap_or(-1),
        discard: async_nats::jetstream::stream::DiscardPolicy::Old,
        ..Default::default()
    }
}

/// How many servers keep the stream: `setting` where one is given (not 0), else 3 when
/// the server connected to says it is one of a cluster of three or more (its INFO's
/// `connect_urls` name every member that takes clients, itself included), else 1 (a
/// single server holds one replica only) — and never fewer than the stream has now
/// (`existing`): a cluster with a member down names fewer, and an agent that updated the
/// stream then would take its copies away. A cluster of three keeps every record
/// through the loss of any one server.
#[cfg(feature = "jetstream")]
pub fn stream_replicas(
    setting: usize,
    server: &async_nats::ServerInfo,
    existing: Option<usize>,
) -> usize {
    let auto = if server.connect_urls.len() >= 3 { 3 } else { 1 };
    match setting {
        0 => auto.max(existing.unwrap_or(0)),
        n => n,
    }
}

/// The longest subject token: a NATS server refuses a control line over 4 KiB (and
/// drops the connection), and a subject carries a cluster, an agent and a model.
pub(crate) const MAX_TOKEN: usize = 64;

/// `s` as one NATS subject token: every character but letters, digits, `-` and `_`
/// replaced by `_` (empty: `default`). A name longer than [`MAX_TOKEN`] becomes its
/// first 47 characters, `-` and 16 hex digits of its hash: still one token per name,
/// the same at every agent and collector.
pub fn token(s: &str) -> String {
    let t: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if t.is_empty() {
        "default".into()
    } else if t.len() > MAX_TOKEN {
        format!(
            "{}-{:016x}",
            &t[..MAX_TOKEN - 17],
            xxhash_rust::xxh3::xxh3_64(s.as_bytes())
        )
    } else {
        t
    }
}

/// Whether `s` is longer than a subject token holds (its token is shortened).
pub fn shortened(s: &str) -> bool {
    s.chars().count() > MAX_TOKEN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_name_is_one_short_token_of_its_own() {
        let long = "m".repeat(8000);
        let other = format!("{}x", "m".repeat(7999));
        let (a, b) = (token(&long), token(&other));
        assert_eq!(a.len(), MAX_TOKEN);
        assert_ne!(a, b, "two long names, two tokens");
        assert_eq!(a, token(&long), "the same everywhere");
        assert!(shortened(&long) && !shortened("llama"));
        let s = Subjects::new("c");
        assert!(s.of_model(&long).len() < 100);
    }

    #[test]
    fn subjects_are_single_tokens() {
        let s = Subjects::new("lab.1 x");
        assert_eq!(s.all(), "kvscope.lab_1_x.>");
        assert_eq!(s.stream_name(), "KVSCOPE_LAB_1_X");
    }

    #[test]
    fn a_bundle_s_scope_is_its_agent_and_model() {
        use crate::record::{AgentHeartbeat, Record};
        let s = Subjects::new("prod");
        let hb = Record::Heartbeat(AgentHeartbeat::default());
        let plain = s.for_record("node 1", &hb);
        let model = s.for_record_in_model("node 1", &hb, "llama 3");
        assert_eq!(s.scope_of(&plain), Some("kvscope.prod.node_1"));
        assert_eq!(s.scope_of(&model), Some("kvscope.prod.node_1.m.llama_3"));
        let bundle = Subjects::bundle_subject(s.scope_of(&model).unwrap());
        assert_eq!(bundle, "kvscope.prod.node_1.m.llama_3.records");
        assert_eq!(s.scope_of(&bundle), s.scope_of(&model));
        assert!(s.subject_matches_agent(&bundle, "node 1"));
        assert_eq!(s.model_of(&bundle), Some("llama_3"));
        assert_eq!(s.scope_of("kvscope.other.node_1.heartbeat"), None);
        assert_eq!(s.scope_of("kvscope.prod.node_1"), None);
    }

    #[test]
    fn every_subject_names_its_agent() {
        use crate::record::{AgentHeartbeat, Record};
        let s = Subjects::new("prod");
        let hb = Record::Heartbeat(AgentHeartbeat::default());
        let subject = s.for_record("node 1", &hb);
        assert_eq!(subject, "kvscope.prod.node_1.heartbeat");
        assert_eq!(s.agent_of(&subject), Some("node_1"));
        assert!(s.subject_matches_agent(&subject, "node 1"));
        assert!(!s.subject_matches_agent(&subject, "node-2"));
        assert!(subject.starts_with(s.of_agent("node 1").trim_end_matches('>')));
        for bad in [
            "kvscope.prod.x",
            "kvscope.other.a.kv.1",
            "kvscope.prodx.a.kv",
            "x.prod.a.kv",
        ] {
            assert_eq!(s.agent_of(bad), None, "{bad}");
        }
        assert_eq!(
            s.inbox_prefix("kvscope-collector"),
            "_INBOX_kvscope.prod.kvscope-collector"
        );
    }

    #[test]
    fn a_model_s_records_and_copies_share_one_filter() {
        use crate::record::{AgentHeartbeat, Record};
        let s = Subjects::new("prod");
        let hb = Record::Heartbeat(AgentHeartbeat::default());
        let copy = s.for_record_in_model("node-1", &hb, "llama 70b");
        assert_eq!(copy, "kvscope.prod.node-1.m.llama_70b.heartbeat");
        assert_eq!(s.model_of(&copy), Some("llama_70b"));
        assert!(s.is_model_copy(&copy));
        assert!(
            !s.is_model_copy(&s.for_record("node-1", &hb)),
            "the plain one"
        );
        assert_eq!(s.agent_of(&copy), Some("node-1"), "still names its agent");
        assert!(s.subject_matches_agent(&copy, "node-1"));
        assert_eq!(s.of_model("llama 70b"), "kvscope.prod.*.m.llama_70b.>");
        // The filter matches the model's subjects (one token per `*`) and no other's.
        let matches = |filter: &str, subject: &str| {
            let (f, t): (Vec<&str>, Vec<&str>) =
                (filter.split('.').collect(), subject.split('.').collect());
            f.iter()
                .enumerate()
                .all(|(i, p)| *p == ">" || t.get(i).is_some_and(|x| *p == "*" || p == x))
                && (f.last() == Some(&">") || f.len() == t.len())
        };
        assert!(matches(&s.of_model("llama 70b"), &copy));
        assert!(!matches(&s.of_model("mistral"), &copy));
        assert!(!matches(
            &s.of_model("llama 70b"),
            &s.for_record("node-1", &hb)
        ));
        assert_eq!(s.model_of("kvscope.prod.node-1.kv.7"), None);
    }

    #[test]
    fn an_agent_may_publish_its_own_records_only_and_the_collector_none() {
        let s = Subjects::new("prod");
        let a = s.agent_permissions("node-1");
        assert_eq!(a.publish[0], "kvscope.prod.node-1.>");
        assert!(a.publish[1..]
            .iter()
            .all(|p| p.starts_with("$JS.API.STREAM.")));
        assert_eq!(a.subscribe, ["_INBOX_kvscope.prod.node-1.>"]);
        let c = s.collector_permissions("kvscope-collector");
        assert!(
            c.publish.iter().all(|p| p.starts_with("$JS.")
                || *p == "$KV.KVSCOPE_PROD_LEASES.kvscope-collector"),
            "{c:?}"
        );
        let both = a
            .clone()
            .merge(Subjects::new("dev").agent_permissions("node-1"));
        assert_eq!(both.publish.len(), 8);
        assert_eq!(a.clone().merge(a.clone()), a);
        assert!(a
            .to_nats_conf()
            .starts_with("permissions: { publish: { allow: [\"kvscope.prod.node-1.>\""));
    }

    /// docs/bus-security.md shows operators these lists for cluster `prod`: they must stay the
    /// ones the product needs.
    #[test]
    fn the_readme_lists_these_permissions() {
        let readme = include_str!("../../docs/bus-security.md");
        let s = Subjects::new("prod");
        let a = s.agent_permissions("node-1");
        let c = s.collector_permissions("kvscope-collector");
        for p in [a, c]
            .iter()
            .flat_map(|p| p.publish.iter().chain(&p.subscribe))
        {
            assert!(
                readme.contains(&format!("\"{p}\"")),
                "docs/bus-security.md lacks {p}"
            );
        }
    }
}
