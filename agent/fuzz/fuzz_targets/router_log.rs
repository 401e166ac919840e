//! Any text as router log lines — tracing's text format, Dynamo's JSON lines, the
//! request trace, Kubernetes CRI lines with partials — through the CRI joiner and the
//! parser and joiner: never a panic, every line counted as something.
#![no_main]

use kvscope_agent::taps::router::cri::CriJoiner;
use kvscope_agent::taps::router::join::RouterLogProcessor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut cri = CriJoiner::new(1 << 12);
    let mut p = RouterLogProcessor::new(30_000_000_000, 64);
    for line in text.lines() {
        let _ = kvscope_agent::taps::router::parse::parse_line(line);
        if let kvscope_agent::taps::router::cri::CriOutput::Line { text, .. } = cri.push(line) {
            let _ = p.line(&text, 1_796_000_000_000_000_000);
        }
    }
    let _ = cri.finish();
    let _ = p.finish();
});
