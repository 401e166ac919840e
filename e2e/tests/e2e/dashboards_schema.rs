//! The Grafana dashboards against Grafana's own definitions, since no Grafana server can
//! run here: each dashboard, as a TypeScript object literal, must type-check as
//! `@grafana/schema`'s `Dashboard` (strict, excess properties refused; its string enums
//! taken as their literal values, which is what the JSON holds), and carry the
//! `schemaVersion` the package's `defaultDashboard` has — what Grafana writes now. A
//! dashboard with a property the schema does not know must fail the same check.
//! `scripts/setup` installs the packages under `.lab/grafana-schema`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `T`, with every string enum replaced by its string values (JSON has no enums).
const PRELUDE: &str = "import type { Dashboard } from '@grafana/schema';\n\
type Lit<T> = T extends string ? `${T}` : T extends number | boolean | null | undefined ? T \
: T extends Array<infer U> ? Array<Lit<U>> : T extends object ? { [K in keyof T]: Lit<T[K]> } : T;\n";

/// Type-check `dashboards` (name, JSON) in a folder under the installed packages: tsc's
/// exit status and output.
fn type_check(packages: &Path, dashboards: &[(String, String)]) -> (bool, String) {
    let dir = tempfile::Builder::new()
        .prefix("check-")
        .tempdir_in(packages)
        .unwrap();
    for (i, (_, json)) in dashboards.iter().enumerate() {
        std::fs::write(
            dir.path().join(format!("d{i}.ts")),
            format!("{PRELUDE}export const d{i}: Lit<Dashboard> = {json};\n"),
        )
        .unwrap();
    }
    std::fs::write(
        dir.path().join("tsconfig.json"),
        r#"{ "compilerOptions": { "strict": true, "noEmit": true, "target": "es2020",
             "module": "esnext", "moduleResolution": "bundler", "skipLibCheck": true },
             "include": ["*.ts"] }"#,
    )
    .unwrap();
    let out = Command::new(packages.join("node_modules/.bin/tsc"))
        .arg("-p")
        .arg(dir.path())
        .output()
        .expect("tsc runs");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    // Name the dashboards in the output instead of d0.ts, d1.ts, ….
    for (i, (name, _)) in dashboards.iter().enumerate() {
        text = text.replace(&format!("d{i}.ts"), name);
    }
    (out.status.success(), text)
}

#[test]
fn every_dashboard_type_checks_as_grafanas_dashboard_at_its_current_schema_version() {
    let packages = repo().join(".lab/grafana-schema");
    assert!(
        packages
            .join("node_modules/@grafana/schema/package.json")
            .is_file(),
        "@grafana/schema is missing under {}: run scripts/setup",
        packages.display()
    );
    let mut dashboards = Vec::new();
    for e in std::fs::read_dir(repo().join("dashboards/grafana/dashboards")).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "json") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            dashboards.push((name, std::fs::read_to_string(&path).unwrap()));
        }
    }
    assert!(dashboards.len() >= 4, "{dashboards:?}");
    let (ok, out) = type_check(&packages, &dashboards);
    assert!(ok, "the dashboards against @grafana/schema:\n{out}");

    // The check can fail: a property the schema does not know is refused.
    let (name, json) = &dashboards[0];
    let broken = json.replacen('{', "{\n  \"panelsPerRow\": 3,", 1);
    let (ok, out) = type_check(&packages, &[(name.clone(), broken)]);
    assert!(!ok && out.contains("panelsPerRow"), "{out}");

    // At the schema version Grafana writes now.
    let out = Command::new("node")
        .args([
            "--input-type=module",
            "-e",
            "import('@grafana/schema').then(m => console.log(m.defaultDashboard.schemaVersion))",
        ])
        .current_dir(&packages)
        .output()
        .expect("node runs");
    let current: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    for (name, json) in &dashboards {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["schemaVersion"], current, "{name}");
    }
}
