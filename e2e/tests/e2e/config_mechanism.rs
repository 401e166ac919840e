//! One config mechanism in the three daemons, on the real binary: defaults < TOML file <
//! `KVSCOPE_<DAEMON>_*` variables < flags, and the printed config (`print-config`) with
//! secrets left out (an OTLP `authorization` header, the actuator's API token).

use std::process::Command;

const SECRET: &str = "Bearer s3cr3t-0123456789";

fn print_config(args: &[&str], env: &[(&str, &str)]) -> toml::Table {
    let mut cmd = Command::new(kvscope_e2e::kvscope());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("s3cr3t"),
        "{args:?} printed a secret:\n{text}"
    );
    toml::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: not TOML ({e}):\n{text}"))
}

#[test]
fn file_then_environment_then_flags_and_no_secret_printed() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let header = (
        "OTEL_EXPORTER_OTLP_HEADERS",
        "authorization=Bearer s3cr3t-0123456789",
    );
    assert!(header.1.ends_with(&SECRET["Bearer ".len()..]));

    // The agent: cluster from the file, NATS from the environment over the file's, the
    // agent id from the flag over the environment's.
    let agent = file(
        "agent.toml",
        "cluster = \"from-file\"\nnats_url = \"nats://file:4222\"\nagent_id = \"file\"\n",
    );
    let c = print_config(
        &[
            "agent",
            "--config",
            &agent,
            "--agent-id",
            "flag",
            "--print-config",
        ],
        &[
            ("KVSCOPE_AGENT_NATS_URL", "nats://env:4222"),
            ("KVSCOPE_AGENT_ID", "env"),
            header,
        ],
    );
    assert_eq!(c["cluster"].as_str(), Some("from-file"));
    assert_eq!(c["nats_url"].as_str(), Some("nats://env:4222"));
    assert_eq!(c["agent_id"].as_str(), Some("flag"));
    assert_eq!(
        c["otlp"]["headers"]["authorization"].as_str(),
        Some(kvscope_kit::config::REDACTED)
    );

    // The collector, the same way.
    let collector = file(
        "collector.toml",
        "cluster = \"from-file\"\ndurable_name = \"file\"\n[analyzer]\nwindow_secs = 30.0\nwarmup_secs = 30.0\n",
    );
    let c = print_config(
        &[
            "collector",
            "--config",
            &collector,
            "--window-secs",
            "7",
            "print-config",
        ],
        &[
            ("KVSCOPE_COLLECTOR_DURABLE_NAME", "env"),
            ("KVSCOPE_COLLECTOR_WINDOW_SECS", "9"),
            ("KVSCOPE_COLLECTOR_WARMUP_SECS", "4"),
            header,
        ],
    );
    assert_eq!(c["cluster"].as_str(), Some("from-file"));
    assert_eq!(c["durable_name"].as_str(), Some("env"));
    assert_eq!(c["analyzer"]["warmup_secs"].as_float(), Some(4.0));
    assert_eq!(c["analyzer"]["window_secs"].as_float(), Some(7.0));
    assert_eq!(
        c["otlp"]["headers"]["authorization"].as_str(),
        Some(kvscope_kit::config::REDACTED)
    );

    // The actuator: its API token given in the environment is never printed.
    let actuator = file(
        "actuator.toml",
        "interval_secs = 2.0\ncollector_url = \"http://file:9465\"\naudit_log = \"file.jsonl\"\n",
    );
    let c = print_config(
        &[
            "actuator",
            "--config",
            &actuator,
            "--audit-log",
            "flag.jsonl",
            "print-config",
        ],
        &[
            ("KVSCOPE_ACTUATOR_COLLECTOR_URL", "http://env:9465"),
            ("KVSCOPE_ACTUATOR_AUDIT_LOG", "env.jsonl"),
            ("KVSCOPE_ACTUATOR_API_TOKEN", "s3cr3t-0123456789"),
        ],
    );
    assert_eq!(c["interval_secs"].as_float(), Some(2.0));
    assert_eq!(c["collector_url"].as_str(), Some("http://env:9465"));
    assert_eq!(c["audit_log"].as_str(), Some("flag.jsonl"));

    // A variable that does not parse is named, and the daemon does not start.
    let out = Command::new(kvscope_e2e::kvscope())
        .args(["collector", "print-config"])
        .env("KVSCOPE_COLLECTOR_LISTEN", "everywhere")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("KVSCOPE_COLLECTOR_LISTEN=\"everywhere\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
