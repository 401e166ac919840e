//! Replaying a recording through the same analyzer the live collector runs.

use kvscope_fold::analyzer::{AnalyzerConfig, FleetAnalyzer};
use kvscope_wire::recording::{read_recording, RecordingError};
use kvscope_wire::Envelope;
use std::path::Path;
use tracing::warn;

/// Fold the recording at `path`. Lines that are not valid records are counted as
/// undecodable records (and logged), as the live collector counts bad bus messages.
pub fn replay(path: &Path, cfg: AnalyzerConfig) -> Result<FleetAnalyzer, RecordingError> {
    replay_with(path, cfg, |_, _, _| {})
}

/// [`replay`], calling `applied` with the analyzer after each record it applies, and
/// whether it judged a request there.
pub(crate) fn replay_with(
    path: &Path,
    cfg: AnalyzerConfig,
    mut applied: impl FnMut(&FleetAnalyzer, &Envelope, bool),
) -> Result<FleetAnalyzer, RecordingError> {
    let rec = read_recording(path)?;
    let mut a = FleetAnalyzer::new(cfg);
    for env in &rec.envelopes {
        let judged = a.apply(env).is_some();
        applied(&a, env, judged);
    }
    for (line, error) in &rec.bad_lines {
        warn!(line, error = %error, "Recording line is not a record; skipped and counted.");
    }
    a.counters_mut().undecodable_records += rec.bad_lines.len() as u64;
    Ok(a)
}
