//! The collector alone: restarts against a real JetStream, its lease handed over, its HTML
//! report in a real browser.

mod jetstream_restart;
mod lease_handover;
mod report_html_browser;
