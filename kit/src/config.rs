//! Config loading the daemons share (the agent, collector and actuator, and the OTLP
//! settings): the file over the defaults ([`load_file`], [`ConfigFileError`]), then
//! environment overrides (`KVSCOPE_AGENT_*`, `KVSCOPE_COLLECTOR_*`,
//! `KVSCOPE_ACTUATOR_*`, `OTEL_*`) read over the file's values with one set of rules and
//! one error message ([`Env`], [`EnvError`]); the TOML example a config module documents,
//! for the tests that check it parses; and `print-config`, the effective configuration
//! as TOML with secrets left out — what a config can hold in clear (OTLP headers such as
//! an `authorization` token, a password, a token) is printed as `<redacted>`; paths to
//! files holding secrets (`*_file`) are printed.

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A config file that cannot be used: names the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
}

/// The first steps of every daemon's config: its defaults, replaced by the TOML file at
/// `file` when there is one (unknown keys refused where the type says so). Environment
/// overrides ([`Env`]) and flags come after, in the daemon.
pub fn load_file<T: DeserializeOwned + Default>(file: Option<&Path>) -> Result<T, ConfigFileError> {
    let Some(path) = file else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.into(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigFileError::Parse {
        path: path.into(),
        source,
    })
}

/// A variable whose value does not parse: names the variable, the value and what is
/// wrong, so the user knows what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}={value:?}: {message}")]
pub struct EnvError {
    pub key: String,
    pub value: String,
    pub message: String,
}

/// The environment as a config loader reads it: a function from a variable's name to
/// its value (the process environment in the binaries, a closure in tests).
pub struct Env<F>(F);

impl<F: Fn(&str) -> Option<String>> Env<F> {
    pub fn new(var: F) -> Self {
        Self(var)
    }

    /// The value as set.
    pub fn get(&self, key: &str) -> Option<String> {
        (self.0)(key)
    }

    /// The value without surrounding white space.
    pub fn trimmed(&self, key: &str) -> Option<String> {
        self.get(key).map(|v| v.trim().to_string())
    }

    /// The value (trimmed) parsed as a `T`.
    pub fn parse<T: FromStr>(&self, key: &str) -> Result<Option<T>, EnvError>
    where
        T::Err: Display,
    {
        self.get(key).map(|v| parse_value(key, &v)).transpose()
    }

    /// A yes/no switch: `1`, `true` or `yes` turn it on, anything else off.
    pub fn flag(&self, key: &str) -> Option<bool> {
        self.get(key)
            .map(|v| matches!(v.trim(), "1" | "true" | "yes"))
    }

    /// A comma-separated list, each item trimmed and parsed as a `T`; empty items are
    /// skipped. An error names the item that does not parse.
    pub fn list<T: FromStr>(&self, key: &str) -> Result<Option<Vec<T>>, EnvError>
    where
        T::Err: Display,
    {
        self.get(key)
            .map(|v| {
                v.split(',')
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| parse_value(key, s))
                    .collect()
            })
            .transpose()
    }
}

fn parse_value<T: FromStr>(key: &str, v: &str) -> Result<T, EnvError>
where
    T::Err: Display,
{
    v.trim().parse().map_err(|e: T::Err| EnvError {
        key: key.to_string(),
        value: v.to_string(),
        message: e.to_string(),
    })
}

/// The ```` ```toml ```` block of the `//!` docs of a source file (given as its text,
/// e.g. `include_str!("config.rs")`), as plain TOML; `None` when there is none. The
/// config modules document their format with one, and their tests check that it parses.
pub fn documented_toml_example(source: &str) -> Option<String> {
    let start = source.find("//! ```toml")?;
    let end = start + source[start..].find("//! ```\n")?;
    Some(
        source[start..end]
            .lines()
            .skip(1)
            .map(|l| l.trim_start_matches("//!").trim_start())
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

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
    use std::collections::{BTreeMap, HashMap};

    fn env(vars: &[(&str, &str)]) -> Env<impl Fn(&str) -> Option<String>> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Env::new(move |k| vars.get(k).cloned())
    }

    #[test]
    fn values_are_trimmed_and_parsed() {
        let e = env(&[("N", " 42 "), ("S", " a b ")]);
        assert_eq!(e.parse::<u32>("N"), Ok(Some(42)));
        assert_eq!(e.parse::<u32>("UNSET"), Ok(None));
        assert_eq!(e.get("S").as_deref(), Some(" a b "));
        assert_eq!(e.trimmed("S").as_deref(), Some("a b"));
    }

    #[test]
    fn a_bad_value_names_the_variable_and_the_value() {
        let e = env(&[("KVSCOPE_X_CAPACITY", "many")]);
        let err = e.parse::<u32>("KVSCOPE_X_CAPACITY").unwrap_err();
        assert_eq!(
            err.to_string(),
            "KVSCOPE_X_CAPACITY=\"many\": invalid digit found in string"
        );
    }

    #[test]
    fn flags() {
        let e = env(&[
            ("A", "1"),
            ("B", " yes"),
            ("C", "true"),
            ("D", "no"),
            ("E", ""),
        ]);
        let got: Vec<_> = ["A", "B", "C", "D", "E", "F"].map(|k| e.flag(k)).to_vec();
        assert_eq!(
            got,
            [
                Some(true),
                Some(true),
                Some(true),
                Some(false),
                Some(false),
                None
            ]
        );
    }

    #[test]
    fn lists_skip_empty_items_and_name_the_bad_one() {
        let e = env(&[("L", " 1, 2,,3 ,"), ("BAD", "1,x")]);
        assert_eq!(e.list::<u8>("L"), Ok(Some(vec![1, 2, 3])));
        assert_eq!(e.list::<u8>("UNSET"), Ok(None));
        let err = e.list::<u8>("BAD").unwrap_err();
        assert_eq!((err.key.as_str(), err.value.as_str()), ("BAD", "x"));
    }

    #[test]
    fn the_documented_example_is_found() {
        let src = "//! Docs.\n//!\n//! ```toml\n//! a = 1\n//!   [t]\n//! b = \"x\"\n//! ```\n\nfn f() {}\n";
        assert_eq!(
            documented_toml_example(src).as_deref(),
            Some("a = 1\n[t]\nb = \"x\"")
        );
        assert_eq!(documented_toml_example("//! no example\n"), None);
    }

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

    #[test]
    fn a_config_file_is_read_over_the_defaults_and_its_errors_name_it() {
        #[derive(serde::Deserialize, Default, Debug, PartialEq)]
        #[serde(deny_unknown_fields, default)]
        struct C {
            a: u32,
            b: String,
        }
        assert_eq!(load_file::<C>(None).unwrap(), C::default());
        let dir = std::env::temp_dir().join(format!("kvscope-kit-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "a = 3\n").unwrap();
        assert_eq!(
            load_file::<C>(Some(&good)).unwrap(),
            C {
                a: 3,
                b: String::new()
            }
        );
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "c = 1\n").unwrap();
        let e = load_file::<C>(Some(&bad)).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("unknown field"), "{e}");
        let e = load_file::<C>(Some(&dir.join("absent.toml")))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cannot read config file") && e.contains("absent.toml"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
