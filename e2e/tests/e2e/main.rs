//! Every end-to-end test of kvscope, one module per subject, in one binary (one link of
//! the workspace). They run against the real parts (Dynamo's router and mockers, NATS,
//! etcd, Prometheus, the NIXL wheel, eBPF uprobes) through the kit in `e2e/src`
//! (`kvscope_e2e`). DEVELOPING.md names the tiers and how to run one module.

mod agent;
mod alert_rules;
mod bench_freshness;
mod bus_cluster;
mod bus_security;
mod clock_skew;
mod closed_loop;
mod collector;
mod collector_standby;
mod conditional_disagg;
mod config_mechanism;
mod dashboards_schema;
mod dashboards_scrape;
mod data_plane_events;
mod demo;
mod deploy_manifests;
mod disaggregated;
mod discovery_tls;
mod dynamo_releases;
mod event_plane;
mod gap_recovery;
mod hostile;
mod info_decisions;
mod kv_tiers;
mod lab;
mod lab_e2e;
mod late_start;
mod least_privilege;
mod log_formats;
mod long_prompts;
mod models;
mod nixl_owners;
mod nixl_pipeline;
mod oracle_selftest;
mod otlp_export;
mod otlp_retries;
mod output_blocks;
mod pod_endpoints;
mod router_knobs;
mod tenants;
mod whatif_capacity;
