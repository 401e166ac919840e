//! The collector alone: restarts against a real JetStream, its HTML report in a real browser.

mod jetstream_restart;
mod report_html_browser;
