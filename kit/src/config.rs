//! `print-config`: the effective configuration as TOML, secrets left out. What a config
//! can hold in clear — OTLP headers (an `authorization` token), a password, a token —
//! is printed as `<redacted>`; paths to files holding secrets (`*_file`) are printed.

use serde::Serialize;

/// What replaces a secret's value.
pub const REDACTED: &str = "<redacted>";

/// Whether a key names a secret held in clear (not a file that holds one).
fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    !k.ends_with("_file")
        && ["password", "token", "secret", "api_key", "apikey"]
            .iter()
            .any(|s| k.contains(s))
}

fn redact(value: &mut toml::Value) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t.iter_mut() {
                if k == "headers" {
                    if let toml::Value::Table(h) = v {
                        for (_, hv) in h.iter_mut() {
                            *hv = toml::Value::String(REDACTED.into());
                        }
                    }
                } else if secret_key(k) && v.is_str() {
                    *v = toml::Value::String(REDACTED.into());
                } else {
                    redact(v);
                }
            }
        }
        toml::Value::Array(a) => a.iter_mut().for_each(redact),
        _ => {}
    }
}

/// `cfg` as pretty TOML with every secret replaced by [`REDACTED`].
pub fn to_redacted_toml<T: Serialize>(cfg: &T) -> Result<String, toml::ser::Error> {
    let mut value = toml::Value::try_from(cfg)?;
    redact(&mut value);
    toml::to_string_pretty(&value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Serialize)]
    struct Otlp {
        endpoint: String,
        headers: BTreeMap<String, String>,
    }

    #[derive(Serialize)]
    struct Cfg {
        nats_url: String,
        password: Option<String>,
        token_file: String,
        otlp: Otlp,
        exporters: Vec<Otlp>,
    }

    #[test]
    fn secrets_are_redacted_and_the_rest_printed() {
        let otlp = || Otlp {
            endpoint: "https://otel:4318".into(),
            headers: BTreeMap::from([("authorization".into(), "Bearer s3cr3t".into())]),
        };
        let text = to_redacted_toml(&Cfg {
            nats_url: "tls://bus:4222".into(),
            password: Some("hunter2".into()),
            token_file: "/etc/kvscope/token".into(),
            otlp: otlp(),
            exporters: vec![otlp()],
        })
        .unwrap();
        assert!(
            !text.contains("s3cr3t") && !text.contains("hunter2"),
            "{text}"
        );
        assert_eq!(text.matches(REDACTED).count(), 3, "{text}");
        assert!(text.contains("/etc/kvscope/token"));
        assert!(text.contains("tls://bus:4222") && text.contains("https://otel:4318"));
    }
}
