//! Tenants named by a field of the request, nothing else typed: the agent is told which
//! field of a request's arrival line names its tenant (`KVSCOPE_AGENT_TENANT_FIELD`, here
//! the HTTP request's `x_request_id`, which the workload sets to `kvs1-f<family>-…`) and
//! the part of it that does (`KVSCOPE_AGENT_TENANT_PATTERN`, the family). Dynamo 1.6.1's
//! frontend (router temperature 0.5) and 3 mockers, the chat workload of 3 families.
//!
//! Asserts: every verdict names the tenant its request's header carried (the workload's
//! own record of what it sent, set beside the router's id for the request); the
//! per-tenant figures of `/api/tenants` sum to the fleet's (requests, spills, true
//! delta), with no request left unsalted; no arrival line went unread. Needs the lab
//! (`scripts/setup`).

use kvscope_fleet::fleet_run::FleetRunConfig;
use kvscope_lab::workload;
use kvscope_lab::LabConfig;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

const WINDOW_SECS: f64 = 4.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_field_names_each_requests_tenant() {
    // Some randomness in the router's choice, so some requests spill.
    let lab = LabConfig {
        frontend_args: vec!["--router-temperature".into(), "0.5".into()],
        ..LabConfig::default()
    };
    let mut cfg = FleetRunConfig::new(lab, WINDOW_SECS);
    cfg.agent_env.extend([
        ("KVSCOPE_AGENT_TENANT_FIELD".into(), "x_request_id".into()),
        (
            "KVSCOPE_AGENT_TENANT_PATTERN".into(),
            "^[a-z0-9]+-(f[0-9]+)-".into(),
        ),
    ]);
    let run = kvscope_e2e::fleet(cfg)
        .await
        .expect("lab, agent and collector start");
    let summary = workload::run(run.chat_workload(12.0))
        .await
        .expect("the workload runs");
    assert_eq!(summary.failed, 0, "every workload request succeeds");
    let ids = summary.router_request_ids();
    run.wait_for_decisions(ids.len() as u64, Duration::from_secs(60))
        .await
        .expect("every decision reaches the collector");
    run.wait_drained(Duration::from_secs(1), Duration::from_secs(60))
        .await
        .expect("the collector catches up");
    let verdicts: Vec<Value> = run
        .get_json("/api/verdicts?limit=100000")
        .await
        .expect("the verdicts");
    let tenants: Value = run.get_json("/api/tenants").await.expect("the tenants");
    let s: Value = run.summary().await.expect("the summary");
    run.finish().await.expect("the run ends cleanly");

    // What each request's header said, by the router's id of it.
    let sent: HashMap<&str, String> = summary
        .requests
        .iter()
        .filter_map(|r| {
            let id = r.router_request_id.as_deref()?;
            Some((id, format!("f{}", r.family)))
        })
        .collect();
    assert_eq!(verdicts.len(), ids.len());
    let mut by_tenant: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for v in &verdicts {
        let id = v["request_id"].as_str().unwrap();
        let tenant = v["tenant"]
            .as_str()
            .unwrap_or_else(|| panic!("no tenant: {v}"));
        assert_eq!(Some(&tenant.to_string()), sent.get(id), "{v}");
        let e = by_tenant.entry(tenant.to_string()).or_default();
        e.0 += 1;
        e.1 += u64::from(v["spill"] == true);
        e.2 += v["true_delta_tokens"].as_u64().unwrap_or(0);
    }
    eprintln!("per tenant (requests, spills, true delta): {by_tenant:?}");
    assert_eq!(by_tenant.len(), 3, "the workload's three families");
    // The collector's per-tenant figures: each tenant's as counted from the verdicts,
    // summing to the fleet's.
    let fleet = (
        verdicts.len() as u64,
        s["counters"]["spills"].as_u64().unwrap(),
        by_tenant.values().map(|t| t.2).sum::<u64>(),
    );
    let mut sum = (0, 0, 0);
    for (tenant, want) in &by_tenant {
        let t = &tenants["tenants"][tenant];
        let got = (
            t["requests"].as_u64().unwrap(),
            t["spills"].as_u64().unwrap(),
            t["true_delta_tokens"].as_u64().unwrap(),
        );
        assert_eq!(&got, want, "tenant {tenant}: {tenants}");
        sum = (sum.0 + got.0, sum.1 + got.1, sum.2 + got.2);
    }
    assert_eq!(sum, fleet, "{tenants}");
    assert_eq!(tenants["unsalted"]["requests"], 0, "{tenants}");
    assert!(fleet.1 > 0, "the router spilled");
    let agents = s["agents"].as_object().expect("the agents");
    assert!(!agents.is_empty());
    for a in agents.values() {
        let counters = a["heartbeat"]["counters"].as_object().expect("counters");
        assert!(counters["decisions_joined"].as_u64().unwrap() > 0);
        // A counter at zero is left out of the heartbeat.
        let unread = counters
            .get("router_tenants_unread")
            .and_then(Value::as_u64);
        assert_eq!(
            unread.unwrap_or(0),
            0,
            "every arrival line named its tenant"
        );
    }
}
