//! kvscope's decoder of engines' KV event payloads against the one Dynamo 1.6.1's
//! publisher runs on them (`dynamo_kv_router::zmq_wire::decode_event_batch`, which
//! resolves a store's cache namespace from its `cache_salt`, or else from the salt its
//! vLLM handler tags in the first block's `extra_keys`): the same cache salt for every
//! store, in vLLM's positional layout and in maps.

use dynamo_kv_router::zmq_wire::{decode_event_batch, RawKvEvent};
use kvscope_wire::vllm_events::decode_payload;
use kvscope_wire::KvEvent;
use rmpv::Value;

fn s(x: &str) -> Value {
    Value::from(x)
}

fn encode(events: Vec<Value>) -> Vec<u8> {
    let batch = Value::Array(vec![Value::F64(1.5), Value::Array(events), Value::Nil]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// One BlockStored of two blocks, positional (vLLM's order) or as a map.
fn stored(
    map: bool,
    lora: Option<&str>,
    salt: Option<&str>,
    first_keys: Option<Vec<Value>>,
) -> Value {
    let extra_keys = match first_keys {
        Some(keys) => Value::Array(vec![Value::Array(keys), Value::Nil]),
        None => Value::Nil,
    };
    let opt = |x: Option<&str>| x.map_or(Value::Nil, Value::from);
    if !map {
        // vLLM's positional layout has no top-level cache_salt.
        assert!(salt.is_none());
        return Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
            Value::Nil,
            Value::Array((1..=32u64).map(Value::from).collect()),
            Value::from(16u64),
            Value::Nil,
            s("GPU"),
            opt(lora),
            extra_keys,
        ]);
    }
    let mut m = vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(vec![Value::from(1u64), Value::from(2u64)]),
        ),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array((1..=32u64).map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(16u64)),
        (s("medium"), s("GPU")),
        (s("lora_name"), opt(lora)),
        (s("extra_keys"), extra_keys),
    ];
    if let Some(salt) = salt {
        m.push((s("cache_salt"), s(salt)));
    }
    Value::Map(m)
}

#[test]
fn cache_salts_read_as_dynamos_publisher_reads_them() {
    let tagged = |x: &str| s(&format!("dynamo-cache-salt:{x}"));
    let mut cases = Vec::new();
    for map in [false, true] {
        for lora in [
            None,
            Some("adapter"),
            Some("dynamo-cache-salt:lora-looks-tagged"),
        ] {
            let key_sets: Vec<Option<Vec<Value>>> = vec![
                None,
                Some(vec![]),
                Some(vec![s("adapter"), tagged("tenant-a")]),
                Some(vec![tagged("lora-looks-tagged"), tagged("tenant-b")]),
                Some(vec![s("untagged-salt")]),
                Some(vec![tagged("")]),
                Some(vec![
                    Value::Array(vec![s("mm-hash"), Value::from(3u64)]),
                    tagged("tenant-c"),
                ]),
            ];
            for keys in key_sets {
                cases.push(stored(map, lora, None, keys.clone()));
                if map {
                    // A top-level salt wins over the tagged one, and an empty one too.
                    cases.push(stored(map, lora, Some("top"), keys.clone()));
                    cases.push(stored(map, lora, Some(""), keys));
                }
            }
        }
    }
    let mut salted = 0;
    for ev in cases {
        let input = encode(vec![ev.clone()]);
        let theirs = decode_event_batch(&input).expect("Dynamo decodes it");
        let RawKvEvent::BlockStored {
            cache_namespace, ..
        } = &theirs.events[0]
        else {
            panic!("{:?}", theirs.events)
        };
        let ours = decode_payload(&input).expect("kvscope decodes it");
        let KvEvent::BlockStored { cache_salt, .. } = &ours.events[0] else {
            panic!("{:?}", ours.events)
        };
        assert_eq!(cache_salt, cache_namespace, "{ev}");
        salted += usize::from(cache_salt.as_deref().is_some_and(|s| !s.is_empty()));
    }
    assert!(salted >= 10, "{salted}");
}
