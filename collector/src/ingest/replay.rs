//! Replaying a recording through the same analyzer the live collector runs.

use crate::fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_wire::recording::{read_recording, RecordingError};
use std::path::Path;
use tracing::warn;

/// Fold the recording at `path`. Lines that are not valid records are counted as
/// undecodable records (and logged), as the live collector counts bad bus messages.
pub fn replay(path: &Path, cfg: AnalyzerConfig) -> Result<FleetAnalyzer, RecordingError> {
    replay_with(path, cfg, |_| {})
}

/// [`replay`], calling `judged` with the analyzer after each request it judges.
pub fn replay_with(
    path: &Path,
    cfg: AnalyzerConfig,
    mut judged: impl FnMut(&FleetAnalyzer),
) -> Result<FleetAnalyzer, RecordingError> {
    let rec = read_recording(path)?;
    let mut a = FleetAnalyzer::new(cfg);
    for env in &rec.envelopes {
        if a.apply(env).is_some() {
            judged(&a);
        }
    }
    for (line, error) in &rec.bad_lines {
        warn!(line, error = %error, "Recording line is not a record; skipped and counted.");
    }
    a.counters_mut().undecodable_records += rec.bad_lines.len() as u64;
    Ok(a)
}
