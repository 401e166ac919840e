//! NATS subject names: `kvscope.<cluster>.<kind>[.<worker or agent>]`, all in one
//! JetStream stream per cluster so the collector sees one total order.

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

    pub fn for_record(&self, agent: &str, record: &Record) -> String {
        match record {
            Record::KvEvents(b) => format!("kvscope.{}.kv.{}", self.cluster, b.worker.worker_id),
            Record::Decision(_) => format!("kvscope.{}.decision", self.cluster),
            Record::Migration(_) => format!("kvscope.{}.migration", self.cluster),
            Record::Heartbeat(_) => format!("kvscope.{}.agent.{}", self.cluster, token(agent)),
            Record::Nixl(_) => format!("kvscope.{}.nixl.{}", self.cluster, token(agent)),
            Record::Worker(_) => format!("kvscope.{}.fleet", self.cluster),
        }
    }
}

/// The stream both the agents and the collector ask for (either may start first):
/// every subject of the cluster, on disk, records kept for `max_age`.
#[cfg(feature = "jetstream")]
pub fn stream_config(
    subjects: &Subjects,
    max_age: std::time::Duration,
) -> async_nats::jetstream::stream::Config {
    async_nats::jetstream::stream::Config {
        name: subjects.stream_name(),
        subjects: vec![subjects.all()],
        storage: async_nats::jetstream::stream::StorageType::File,
        max_age,
        ..Default::default()
    }
}

fn token(s: &str) -> String {
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
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_single_tokens() {
        let s = Subjects::new("lab.1 x");
        assert_eq!(s.all(), "kvscope.lab_1_x.>");
        assert_eq!(s.stream_name(), "KVSCOPE_LAB_1_X");
    }
}
