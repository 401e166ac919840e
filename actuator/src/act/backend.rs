//! Where the mode is switched: an HTTP endpoint (PUT the mode), a command (argv template,
//! run without a shell, e.g. a rolling `kubectl set env`), or a file (written atomically).
//!
//! Templates (command arguments, file content) substitute `{mode}` with the value of
//! `DYN_KV_MIGRATION` (`0`, `dry`, `1`) and `{state}` with `off`, `dry` or `live`.

use crate::act::mode::Mode;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncReadExt as _;

/// Default content of a file backend: an environment file.
pub(crate) const DEFAULT_FILE_CONTENT: &str = "DYN_KV_MIGRATION={mode}\n";

/// One mode backend, as configured (`[[mode_backends]]`, tagged by `kind`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModeBackendConfig {
    /// `PUT url` with a JSON body `{"dyn_kv_migration": "dry", "state": "dry",
    /// "reason": "…", "at_ns": …}`; any 2xx is success.
    Http {
        url: String,
        /// File holding a bearer token the endpoint wants (default none).
        #[serde(default)]
        token_file: Option<PathBuf>,
        /// Seconds (default 10).
        #[serde(default = "default_http_timeout")]
        timeout_secs: f64,
    },
    /// Run `argv` (templated, no shell); exit status 0 is success. A command that leaves
    /// a process behind must not leave it holding the command's stdout/stderr.
    Command {
        argv: Vec<String>,
        /// Seconds before the command is killed and counted as failed (default 60).
        #[serde(default = "default_command_timeout")]
        timeout_secs: f64,
    },
    /// Write the templated `content` to `path` (temporary file + rename).
    File {
        path: PathBuf,
        /// Default `DYN_KV_MIGRATION={mode}\n`.
        #[serde(default = "default_file_content")]
        content: String,
    },
}

fn default_http_timeout() -> f64 {
    10.0
}
fn default_command_timeout() -> f64 {
    60.0
}
fn default_file_content() -> String {
    DEFAULT_FILE_CONTENT.into()
}

impl ModeBackendConfig {
    pub fn validate(&self) -> Result<(), String> {
        match self {
            ModeBackendConfig::Http {
                url, timeout_secs, ..
            } => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!("mode backend url {url:?} is not an http:// URL"));
                }
                positive(*timeout_secs)
            }
            ModeBackendConfig::Command { argv, timeout_secs } => {
                if argv.first().is_none_or(|p| p.trim().is_empty()) {
                    return Err("mode backend command has an empty argv".into());
                }
                positive(*timeout_secs)
            }
            ModeBackendConfig::File { path, .. } => {
                if path.as_os_str().is_empty() {
                    Err("mode backend file has an empty path".into())
                } else {
                    Ok(())
                }
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            ModeBackendConfig::Http { url, .. } => format!("http PUT {url}"),
            ModeBackendConfig::Command { argv, .. } => format!("command {}", argv.join(" ")),
            ModeBackendConfig::File { path, .. } => format!("file {}", path.display()),
        }
    }
}

fn positive(v: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!("mode backend timeout_secs must be > 0 (is {v})"))
    }
}

/// Substitute `{mode}` and `{state}`.
pub fn render(template: &str, mode: Mode) -> String {
    template
        .replace("{mode}", mode.dyn_kv_migration())
        .replace("{state}", mode.as_str())
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{backend}: request failed: {source}")]
    Http {
        backend: String,
        source: reqwest::Error,
    },
    #[error("{backend}: answered {status}: {body}")]
    Status {
        backend: String,
        status: u16,
        body: String,
    },
    #[error("{backend}: cannot start: {source}")]
    Spawn {
        backend: String,
        source: std::io::Error,
    },
    #[error("{backend}: exited with {status}: {stderr}")]
    Exit {
        backend: String,
        status: String,
        stderr: String,
    },
    #[error("{backend}: killed after {secs} s")]
    Timeout { backend: String, secs: f64 },
    #[error("{backend}: {source}")]
    Io {
        backend: String,
        source: std::io::Error,
    },
    #[error("cannot read token file {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A mode backend ready to apply modes.
#[derive(Debug, Clone)]
pub struct ModeBackend {
    cfg: ModeBackendConfig,
    http: Option<(reqwest::Client, Option<String>)>,
}

/// Why the mode is being set, passed to the HTTP backend.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ModeChange<'a> {
    pub dyn_kv_migration: &'static str,
    pub state: &'static str,
    pub reason: &'a str,
    pub at_ns: u64,
}

impl ModeBackend {
    pub fn new(cfg: ModeBackendConfig) -> Result<Self, BackendError> {
        let http = match &cfg {
            ModeBackendConfig::Http {
                token_file,
                timeout_secs,
                ..
            } => {
                let token = match token_file {
                    Some(p) => Some(
                        std::fs::read_to_string(p)
                            .map_err(|source| BackendError::Token {
                                path: p.clone(),
                                source,
                            })?
                            .lines()
                            .next()
                            .unwrap_or("")
                            .trim()
                            .to_string(),
                    ),
                    None => None,
                };
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs_f64(*timeout_secs))
                    .build()
                    .map_err(|source| BackendError::Http {
                        backend: cfg.describe(),
                        source,
                    })?;
                Some((client, token))
            }
            _ => None,
        };
        Ok(Self { cfg, http })
    }

    pub fn describe(&self) -> String {
        self.cfg.describe()
    }

    /// Set `mode`. Returns a short description of what was done.
    pub async fn apply(
        &self,
        mode: Mode,
        reason: &str,
        at_ns: u64,
    ) -> Result<String, BackendError> {
        let backend = self.describe();
        match &self.cfg {
            ModeBackendConfig::Http { url, .. } => {
                let (client, token) = self.http.as_ref().expect("http client built in new");
                let mut req = client.put(url).json(&ModeChange {
                    dyn_kv_migration: mode.dyn_kv_migration(),
                    state: mode.as_str(),
                    reason,
                    at_ns,
                });
                if let Some(t) = token {
                    req = req.bearer_auth(t);
                }
                let resp = req.send().await.map_err(|source| BackendError::Http {
                    backend: backend.clone(),
                    source,
                })?;
                let status = resp.status();
                if status.is_success() {
                    Ok(format!("PUT {url}: {status}"))
                } else {
                    let body = resp.text().await.unwrap_or_default();
                    Err(BackendError::Status {
                        backend,
                        status: status.as_u16(),
                        body: truncate(&body, 300),
                    })
                }
            }
            ModeBackendConfig::Command { argv, timeout_secs } => {
                let args: Vec<String> = argv.iter().map(|a| render(a, mode)).collect();
                run_command(&backend, &args, *timeout_secs).await
            }
            ModeBackendConfig::File { path, content } => {
                let text = render(content, mode);
                let tmp = path.with_file_name(format!(
                    ".{}.kvscope-tmp-{}",
                    path.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    std::process::id()
                ));
                let io = |source| BackendError::Io {
                    backend: backend.clone(),
                    source,
                };
                tokio::fs::write(&tmp, text.as_bytes()).await.map_err(io)?;
                if let Err(e) = tokio::fs::rename(&tmp, path).await {
                    let _ = tokio::fs::remove_file(&tmp).await;
                    return Err(io(e));
                }
                Ok(format!("wrote {}", path.display()))
            }
        }
    }
}

async fn run_command(
    backend: &str,
    args: &[String],
    timeout_secs: f64,
) -> Result<String, BackendError> {
    let mut child = tokio::process::Command::new(&args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| BackendError::Spawn {
            backend: backend.to_string(),
            source,
        })?;
    // Read stderr beside the wait, but never wait on it: a process the command left
    // behind may hold it open.
    let mut stderr = child.stderr.take();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    let reader = tokio::spawn(async move {
        if let Some(s) = stderr.as_mut() {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 || tx.send(buf[..n].to_vec()).await.is_err() {
                    break;
                }
            }
        }
    });
    let status =
        match tokio::time::timeout(Duration::from_secs_f64(timeout_secs), child.wait()).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                reader.abort();
                return Err(BackendError::Io {
                    backend: backend.to_string(),
                    source,
                });
            }
            Err(_) => {
                let _ = child.kill().await;
                reader.abort();
                return Err(BackendError::Timeout {
                    backend: backend.to_string(),
                    secs: timeout_secs,
                });
            }
        };
    // What stderr had by now, plus whatever comes within a moment.
    let mut err = Vec::new();
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        while let Some(chunk) = rx.recv().await {
            err.extend_from_slice(&chunk);
            if err.len() > 16_384 {
                break;
            }
        }
    })
    .await;
    reader.abort();
    let stderr = truncate(String::from_utf8_lossy(&err).trim(), 500);
    if status.success() {
        Ok(format!("ran {}: {status}", args.join(" ")))
    } else {
        Err(BackendError::Exit {
            backend: backend.to_string(),
            status: status.to_string(),
            stderr,
        })
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_substitute_mode_and_state() {
        assert_eq!(
            render("DYN_KV_MIGRATION={mode} # {state}", Mode::Dry),
            "DYN_KV_MIGRATION=dry # dry"
        );
        assert_eq!(render("{mode}/{state}", Mode::Live), "1/live");
        assert_eq!(render("{mode}", Mode::Off), "0");
    }

    #[test]
    fn backend_configs_parse_by_kind() {
        #[derive(Deserialize)]
        struct W {
            b: Vec<ModeBackendConfig>,
        }
        let c = toml::from_str::<W>(
            "[[b]]\nkind = \"http\"\nurl = \"http://x/mode\"\n[[b]]\nkind = \"file\"\npath = \"m.env\"",
        )
        .unwrap()
        .b;
        assert_eq!(
            c[1],
            ModeBackendConfig::File {
                path: "m.env".into(),
                content: DEFAULT_FILE_CONTENT.into()
            }
        );
        assert!(c.iter().all(|b| b.validate().is_ok()));
        assert!(ModeBackendConfig::Command {
            argv: vec![],
            timeout_secs: 1.0
        }
        .validate()
        .is_err());
    }

    #[tokio::test]
    async fn a_failing_command_reports_its_status_and_stderr() {
        let b = ModeBackend::new(ModeBackendConfig::Command {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo cannot set {mode} >&2; exit 3".into(),
            ],
            timeout_secs: 30.0,
        })
        .unwrap();
        let e = b.apply(Mode::Live, "t", 0).await.unwrap_err().to_string();
        assert!(e.contains("exit status: 3"), "{e}");
        assert!(e.contains("cannot set 1"), "{e}");
        let missing = ModeBackend::new(ModeBackendConfig::Command {
            argv: vec!["/nonexistent/kvscope-no-such-command".into()],
            timeout_secs: 30.0,
        })
        .unwrap();
        assert!(matches!(
            missing.apply(Mode::Dry, "t", 0).await,
            Err(BackendError::Spawn { .. })
        ));
    }
}
