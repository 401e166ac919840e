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

/// A pick from `xs`.
fn pick<T: Copy>(rng: &mut fastrand::Rng, xs: &[T]) -> T {
    xs[rng.usize(..xs.len())]
}

/// One engine event as vLLM writes it, with what decides whether a router takes it:
/// KV cache groups and their kinds, locality, ownership, media, and cache salts named
/// outright, tagged in the first block's `extra_keys`, or not at all (a chain's
/// continuation). Maps, and vLLM's positional layout with every trailing field.
fn engine_event(rng: &mut fastrand::Rng) -> Value {
    let opt = |x: Option<&str>| x.map_or(Value::Nil, Value::from);
    let hashes: Vec<Value> = (0..1 + rng.u64(..3))
        .map(|_| Value::from(1 + rng.u64(..12)))
        .collect();
    let medium = pick(
        rng,
        &[None, None, Some("GPU"), Some("CPU"), Some("STORAGE")],
    );
    let group = pick(rng, &[None, None, Some(0u64), Some(0), Some(1), Some(2)]);
    let kind = pick(
        rng,
        &[
            None,
            None,
            None,
            None,
            Some("full_attention"),
            Some("mla_attention"),
            Some("sliding_window"),
            Some("mamba"),
            Some("a_kind_from_later"),
        ],
    );
    let locality = pick(
        rng,
        &[None, None, None, None, None, Some("LOCAL"), Some("REMOTE")],
    );
    let ownership = pick(
        rng,
        &[None, None, None, None, None, None, None, None, Some("kvcr")],
    );
    let positional = rng.u64(..4) == 0;
    match rng.u64(..10) {
        // A clear's own fields (a map's locality and group are not a clear's).
        0 if positional => Value::Array(vec![s("AllBlocksCleared")]),
        0 => {
            let mut m = vec![(s("type"), s("AllBlocksCleared"))];
            m.extend(group.map(|g| (s("group_idx"), Value::from(g))));
            m.extend(locality.map(|l| (s("locality"), s(l))));
            m.extend(ownership.map(|o| (s("ownership"), s(o))));
            Value::Map(m)
        }
        1..=3 => {
            if positional {
                // vLLM's removals name their group only.
                return Value::Array(vec![
                    s("BlockRemoved"),
                    Value::Array(hashes),
                    opt(medium),
                    group.map_or(Value::Nil, Value::from),
                ]);
            }
            let mut m = vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), Value::Array(hashes)),
                (s("medium"), opt(medium)),
            ];
            m.extend(group.map(|g| (s("group_idx"), Value::from(g))));
            m.extend(locality.map(|l| (s("locality"), s(l))));
            m.extend(ownership.map(|o| (s("ownership"), s(o))));
            Value::Map(m)
        }
        _ => {
            let n = hashes.len() as u64;
            let parent = (rng.u64(..3) > 0).then(|| Value::from(1 + rng.u64(..12)));
            let salt = pick(rng, &[None, None, None, Some("tenant-a"), Some("tenant-b")]);
            let tagged = !positional && rng.u64(..2) == 0;
            let extra_keys = match salt {
                Some(salt) if positional || tagged => Value::Array(vec![Value::Array(vec![s(
                    &format!("dynamo-cache-salt:{salt}"),
                )])]),
                _ => Value::Nil,
            };
            let tokens = Value::Array((0..4 * n).map(Value::from).collect());
            if positional {
                return Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(hashes),
                    parent.unwrap_or(Value::Nil),
                    tokens,
                    Value::from(4u64),
                    Value::Nil,
                    opt(medium),
                    Value::Nil,
                    extra_keys,
                    group.map_or(Value::Nil, Value::from),
                    opt(kind),
                    Value::Nil,
                    opt(locality),
                    opt(ownership),
                ]);
            }
            let mut m = vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), Value::Array(hashes)),
                (s("parent_block_hash"), parent.unwrap_or(Value::Nil)),
                (s("token_ids"), tokens),
                (s("block_size"), Value::from(4u64)),
                (s("medium"), opt(medium)),
                (s("extra_keys"), extra_keys),
            ];
            if !tagged {
                m.extend(salt.map(|x| (s("cache_salt"), s(x))));
            }
            m.extend(group.map(|g| (s("group_idx"), Value::from(g))));
            m.extend(kind.map(|k| (s("kv_cache_spec_kind"), s(k))));
            m.extend(locality.map(|l| (s("locality"), s(l))));
            m.extend(ownership.map(|o| (s("ownership"), s(o))));
            Value::Map(m)
        }
    }
}

#[test]
fn the_events_the_mirror_takes_are_the_ones_dynamos_publisher_hands_its_router() {
    use dynamo_kv_router::protocols::WorkerWithDpRank;
    use dynamo_kv_router::zmq_wire::{ZmqEventFilterReason as Theirs, ZmqEventNormalizer};
    use kvscope_wire::kv_admission::{Admission, Refusal};

    let reason = |r: Theirs| match r {
        Theirs::UnsupportedOwnership | Theirs::UnknownOwnership => Refusal::OtherOwner,
        Theirs::NonLocalLocality => Refusal::NotLocal,
        Theirs::NonMainAttentionKind | Theirs::NonMainAttentionGroup => Refusal::OtherCacheGroup,
        Theirs::UnknownKind => Refusal::UnknownCacheKind,
        Theirs::UnlearnedGroupIdx => Refusal::UnlearnedCacheGroup,
        Theirs::AmbiguousCacheNamespace => Refusal::AmbiguousSalt,
        other => panic!("Dynamo refused for a reason the generator does not make: {other:?}"),
    };
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for seed in 1..=40u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut theirs = ZmqEventNormalizer::new(4);
        let mut ours = Admission::default();
        for step in 0..400 {
            let dp = rng.u64(..2);
            let events: Vec<Value> = (0..1 + rng.u64(..4))
                .map(|_| engine_event(&mut rng))
                .collect();
            let batch = Value::Array(vec![
                Value::F64(1.5),
                Value::Array(events.clone()),
                Value::from(dp),
            ]);
            let mut payload = Vec::new();
            rmpv::encode::write_value(&mut payload, &batch).unwrap();
            let their_batch = decode_event_batch(&payload).expect("Dynamo decodes it");
            let our_batch = decode_payload(&payload).expect("kvscope decodes it");
            assert!(our_batch.problems.is_empty(), "{:?}", our_batch.problems);
            let worker = WorkerWithDpRank::new(7, dp as u32);
            for (i, (raw, (mut ev, meta))) in their_batch
                .events
                .into_iter()
                .zip(our_batch.events.into_iter().zip(our_batch.meta))
                .enumerate()
            {
                let want = theirs
                    .preprocess_with_reason(raw, worker)
                    .map(|raw| match raw {
                        RawKvEvent::BlockStored {
                            cache_namespace, ..
                        } => cache_namespace,
                        _ => None,
                    })
                    .map_err(reason);
                let got = ours.admit(dp as u32, &mut ev, &meta).map(|_| match &ev {
                    KvEvent::BlockStored { cache_salt, .. } => cache_salt.clone(),
                    _ => None,
                });
                assert_eq!(
                    got, want,
                    "seed {seed} step {step} event {i}: {}",
                    events[i]
                );
                let outcome = match &got {
                    Ok(Some(_)) => "taken, salted".to_string(),
                    Ok(None) => "taken".to_string(),
                    Err(r) => format!("{r:?}"),
                };
                *outcomes.entry(outcome).or_default() += 1;
            }
        }
    }
    eprintln!("{outcomes:?}");
    // Every way an event is taken or refused happened, many times.
    for outcome in [
        "taken",
        "taken, salted",
        "OtherOwner",
        "NotLocal",
        "OtherCacheGroup",
        "UnknownCacheKind",
        "UnlearnedCacheGroup",
        "AmbiguousSalt",
    ] {
        assert!(
            outcomes.get(outcome).copied().unwrap_or(0) >= 20,
            "{outcome}: {outcomes:?}"
        );
    }
}

/// Multimodal stores: vLLM names each block's multimodal objects in `extra_keys` (the
/// routing hashes Dynamo's frontend marked, alone or as `[hash, offset]`, beside vLLM's
/// own 64-digit hashes, LoRA names and salts, which are none), and the blocks hold the
/// objects' placeholder runs. Seeded stores of every shape — consistent runs, runs that
/// do not map one to one, objects without runs, videos split by timestamps, images and
/// videos mixed — under every placeholder setting (none, image, video, both, one token
/// for both), LoRA and salt included: every block's local hash is the one Dynamo 1.6.1's
/// publisher (`ZmqEventNormalizer` with the model's image and video token ids) hands its
/// router. A hash that ignored the objects, their order or the placeholders would differ.
#[test]
fn media_objects_hash_as_dynamos_publisher_hashes_them() {
    use dynamo_kv_router::protocols::{KvCacheEventData, WorkerWithDpRank};
    use dynamo_kv_router::zmq_wire::ZmqEventNormalizer;
    use kvscope_wire::hashing::MediaPlaceholders;

    const IMAGE: u32 = 151_655;
    const VIDEO: u32 = 151_656;
    const BS: usize = 16;
    let marked = |h: u64| s(&format!("{h:016x}{}", "0".repeat(48)));
    let (mut blocks_checked, mut with_objects, mut padded) = (0, 0, 0);
    for seed in 1..=60u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let settings = [
            MediaPlaceholders::default(),
            MediaPlaceholders {
                image: Some(IMAGE),
                video: None,
            },
            MediaPlaceholders {
                image: None,
                video: Some(VIDEO),
            },
            MediaPlaceholders {
                image: Some(IMAGE),
                video: Some(VIDEO),
            },
            MediaPlaceholders {
                image: Some(IMAGE),
                video: Some(IMAGE),
            },
        ];
        let placeholders = settings[seed as usize % settings.len()];
        let theirs = |bs| {
            ZmqEventNormalizer::new(bs)
                .with_image_token_id(placeholders.image)
                .with_video_token_id(placeholders.video)
        };
        let mut normalizer = theirs(BS as u32);
        for step in 0..40u64 {
            let blocks = 1 + rng.usize(..5);
            let mut tokens = Vec::new();
            let mut keys = Vec::new();
            for _ in 0..blocks {
                let mut block: Vec<u32> = (0..BS).map(|_| rng.u32(..50_000)).collect();
                let objects: Vec<u64> = (0..rng.usize(..4)).map(|_| rng.u64(..)).collect();
                // Placeholder runs: as many as the objects, or not; images, videos split
                // by a timestamp token, or both.
                let runs = match rng.u8(..4) {
                    0 => objects.len(),
                    1 => rng.usize(..4),
                    _ => objects.len().min(2),
                };
                let mut at = 0;
                for r in 0..runs {
                    let token = match rng.u8(..3) {
                        0 => VIDEO,
                        _ if r % 2 == 1 && rng.bool() => VIDEO,
                        _ => IMAGE,
                    };
                    let len = 1 + rng.usize(..3);
                    let start = (at + rng.usize(..2)).min(BS - 1);
                    let end = (start + len).min(BS);
                    block[start..end].fill(token);
                    at = end + 1;
                    if at >= BS {
                        break;
                    }
                }
                tokens.extend(block);
                let mut items: Vec<Value> = Vec::new();
                if rng.bool() {
                    // vLLM's own hash of an object the frontend did not mark: no object.
                    items.push(s(&format!("{:064x}", rng.u128(..) | 1)));
                }
                for o in &objects {
                    items.push(if rng.bool() {
                        marked(*o)
                    } else {
                        Value::Array(vec![marked(*o), Value::from(rng.u64(..BS as u64))])
                    });
                }
                if rng.bool() {
                    items.push(s("adapter-a"));
                }
                keys.push(if items.is_empty() && rng.bool() {
                    Value::Nil
                } else {
                    Value::Array(items)
                });
            }
            let lora = if rng.bool() {
                s("adapter-a")
            } else {
                Value::Nil
            };
            if rng.bool() {
                if let Some(Value::Array(first)) = keys.first_mut() {
                    first.push(s("dynamo-cache-salt:tenant-b"));
                }
            }
            let event = Value::Array(vec![
                s("BlockStored"),
                Value::Array(
                    (0..blocks as u64)
                        .map(|b| Value::from(step * 100 + b + 1))
                        .collect(),
                ),
                Value::Nil,
                Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
                Value::from(BS as u64),
                Value::Nil,
                s("GPU"),
                lora,
                Value::Array(keys),
            ]);
            let payload = encode(vec![event.clone()]);
            let raw = decode_event_batch(&payload)
                .expect("Dynamo decodes it")
                .events
                .remove(0);
            let placed = normalizer
                .normalize(raw, step, WorkerWithDpRank::new(7, 0))
                .expect("Dynamo takes it");
            let KvCacheEventData::Stored(store) = placed.event.data else {
                panic!("not a store");
            };
            let want: Vec<u64> = store.blocks.iter().map(|b| b.tokens_hash.0).collect();
            let mut ours = decode_payload(&payload).expect("kvscope decodes it");
            let meta = ours.meta.remove(0);
            let mut ev = ours.events.remove(0);
            let n = ev.hash_tokens_with_media(&meta.media, placeholders);
            let got = ev.stored_local_hashes().unwrap().into_owned();
            assert_eq!(
                got, want,
                "seed {seed} step {step} {placeholders:?}: {event}"
            );
            blocks_checked += want.len();
            with_objects += n;
            padded += usize::from(
                n > 0 && (placeholders.image.is_some() || placeholders.video.is_some()),
            );
        }
    }
    eprintln!("{blocks_checked} blocks, {with_objects} holding objects, {padded} stores padded");
    assert!(
        with_objects > 500 && padded > 100,
        "{with_objects} {padded}"
    );
}
