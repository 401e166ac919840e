//! Records' long number lists written as one base64 string of their little-endian bytes
//! (URL-safe alphabet, no padding) instead of a JSON array of decimals.
//!
//! A KV event's token ids and block hashes and a decision's local hashes are most of what
//! crosses the bus: at 100k KV blocks/s the decimal arrays were ~11 MB/s of JSON, 95% of
//! it numbers (a 64-bit hash is ~20 characters and a comma; packed, 10.7). Written
//! packed, a list is ~45% shorter for hashes and ~20% for token ids, and neither side
//! formats or parses a number per element.
//!
//! The readers take either form, so recordings and agents from before stay readable (an
//! agent that writes packed lists needs collectors that read them: upgrade collectors
//! first, as for bundles).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serializer};
use std::fmt;
use std::marker::PhantomData;

/// A fixed-width unsigned integer a list is packed of.
pub trait Word: Copy + serde::de::DeserializeOwned {
    const BYTES: usize;
    const NAME: &'static str;
    fn put(self, out: &mut Vec<u8>);
    fn take(bytes: &[u8]) -> Self;
}

macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            const NAME: &'static str = stringify!($t);
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn take(bytes: &[u8]) -> Self {
                let mut b = [0; std::mem::size_of::<$t>()];
                b.copy_from_slice(bytes);
                <$t>::from_le_bytes(b)
            }
        }
    };
}
word!(u32);
word!(u64);

/// The packed form of `words`.
pub fn encode<W: Word>(words: &[W]) -> String {
    let mut bytes = Vec::with_capacity(words.len() * W::BYTES);
    for w in words {
        w.put(&mut bytes);
    }
    URL_SAFE_NO_PAD.encode(bytes)
}

/// The list a packed string holds; an error names what is wrong with it.
pub fn decode<W: Word>(packed: &str) -> Result<Vec<W>, PackedError> {
    let bytes = URL_SAFE_NO_PAD.decode(packed)?;
    if bytes.len() % W::BYTES != 0 {
        return Err(PackedError::Length {
            bytes: bytes.len(),
            word: W::NAME,
        });
    }
    Ok(bytes.chunks_exact(W::BYTES).map(W::take).collect())
}

#[derive(Debug, thiserror::Error)]
pub enum PackedError {
    #[error("a packed number list is not URL-safe base64 without padding: {0}")]
    Base64(#[from] base64::DecodeError),
    #[error("a packed list of {word} holds {bytes} bytes, not a whole number of them")]
    Length { bytes: usize, word: &'static str },
}

/// `#[serde(serialize_with = "packed::write")]` for a `Vec` of [`Word`]s.
pub fn write<W: Word, S: Serializer>(words: &[W], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&encode(words))
}

/// `#[serde(serialize_with = "packed::write_some")]` for an `Option<Vec<_>>` skipped when
/// `None`.
pub(crate) fn write_some<W: Word, S: Serializer>(
    words: &Option<Vec<W>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match words {
        Some(w) => write(w, s),
        None => s.serialize_none(),
    }
}

/// `#[serde(deserialize_with = "packed::read")]`: a packed string or an array of numbers.
pub fn read<'de, W: Word, D: Deserializer<'de>>(d: D) -> Result<Vec<W>, D::Error> {
    d.deserialize_any(Either(PhantomData))
}

/// `#[serde(default, deserialize_with = "packed::read_some")]`: as [`read`], or `null`.
pub(crate) fn read_some<'de, W: Word, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<W>>, D::Error> {
    Ok(Option::<Packed<W>>::deserialize(d)?.map(|p| p.0))
}

/// A list read by [`read`], so that `Option`'s own reader takes care of `null`.
struct Packed<W>(Vec<W>);

impl<'de, W: Word> Deserialize<'de> for Packed<W> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        read(d).map(Packed)
    }
}

struct Either<W>(PhantomData<W>);

impl<'de, W: Word> Visitor<'de> for Either<W> {
    type Value = Vec<W>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of {}: an array, or packed in a string", W::NAME)
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        decode(v).map_err(E::custom)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // Capped: a hostile length hint must not reserve gigabytes.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(w) = seq.next_element::<W>()? {
            out.push(w);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Lists {
        #[serde(serialize_with = "write", deserialize_with = "read")]
        tokens: Vec<u32>,
        #[serde(serialize_with = "write", deserialize_with = "read")]
        hashes: Vec<u64>,
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            serialize_with = "write_some",
            deserialize_with = "read_some"
        )]
        more: Option<Vec<u64>>,
    }

    #[test]
    fn every_length_and_extreme_round_trips() {
        for n in 0..20u32 {
            let l = Lists {
                tokens: (0..n)
                    .map(|i| i.wrapping_mul(0x9E37_79B9))
                    .chain([u32::MAX])
                    .collect(),
                hashes: (0..u64::from(n))
                    .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                    .chain([0, u64::MAX])
                    .collect(),
                more: (n % 2 == 0).then(|| vec![u64::from(n); n as usize]),
            };
            let json = serde_json::to_string(&l).unwrap();
            assert!(!json.contains('['), "written packed: {json}");
            assert_eq!(serde_json::from_str::<Lists>(&json).unwrap(), l);
        }
    }

    #[test]
    fn arrays_as_written_before_read_the_same() {
        let old = r#"{"tokens":[1,2,4294967295],"hashes":[18446744073709551615,0],"more":[7]}"#;
        let l: Lists = serde_json::from_str(old).unwrap();
        assert_eq!(l.tokens, vec![1, 2, u32::MAX]);
        assert_eq!(l.hashes, vec![u64::MAX, 0]);
        assert_eq!(l.more, Some(vec![7]));
        let none: Lists = serde_json::from_str(r#"{"tokens":[],"hashes":"","more":null}"#).unwrap();
        assert_eq!(none.more, None);
        assert!(none.hashes.is_empty());
        // Packed, the same lists: decimals and packed strings mean the same thing.
        let packed = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<Lists>(&packed).unwrap(), l);
    }

    #[test]
    fn packed_is_shorter_than_decimals() {
        let hashes: Vec<u64> = (1..=64u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let decimal = serde_json::to_string(&hashes).unwrap();
        assert!(
            encode(&hashes).len() * 10 < decimal.len() * 6,
            "{} vs {}",
            encode(&hashes).len(),
            decimal.len()
        );
    }

    #[test]
    fn malformed_lists_are_refused_with_a_reason() {
        let cases = [
            (r#"{"tokens":"AQID","hashes":[]}"#, "not a whole number"),
            (r#"{"tokens":"AQ=D","hashes":[]}"#, "base64"),
            (r#"{"tokens":"+/8A","hashes":[]}"#, "base64"),
            (r#"{"tokens":[1,-2],"hashes":[]}"#, "invalid value"),
            (r#"{"tokens":[4294967296],"hashes":[]}"#, "invalid value"),
            (r#"{"tokens":7,"hashes":[]}"#, "a list of u32"),
            (r#"{"tokens":[],"hashes":"AAAAAAAAAA"}"#, "u64"),
            (r#"{"tokens":[],"hashes":[],"more":{}}"#, "list of u64"),
        ];
        for (json, why) in cases {
            let e = serde_json::from_str::<Lists>(json).unwrap_err().to_string();
            assert!(e.contains(why), "{json}: {e}");
        }
    }

    #[test]
    fn the_decoder_reads_what_any_encoder_of_the_same_alphabet_wrote() {
        // Independent of `encode`: bytes 01 00 00 00 02 00 00 00 in URL-safe base64.
        assert_eq!(decode::<u32>("AQAAAAIAAAA").unwrap(), vec![1, 2]);
        assert_eq!(decode::<u64>("__________8").unwrap(), vec![u64::MAX]);
    }
}
