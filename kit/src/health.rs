//! Liveness and readiness. A daemon is live while it answers (`/healthz`); it is ready
//! (`/readyz`) when every check it registered holds — connected to its bus, its first
//! read of the collector done — and otherwise answers 503 with the checks that do not
//! hold and why, so `kubectl describe pod` says what is wrong.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Named readiness checks, each holding or failing with a reason.
#[derive(Debug, Default)]
pub struct Health {
    checks: Mutex<BTreeMap<&'static str, Option<String>>>,
}

impl Health {
    pub fn new() -> Self {
        Self::default()
    }

    fn set(&self, check: &'static str, state: Option<String>) {
        self.checks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(check, state);
    }

    /// `check` holds from now on.
    pub fn ok(&self, check: &'static str) {
        self.set(check, None);
    }

    /// `check` does not hold, for `reason` (also how a check is registered before it
    /// first holds).
    pub fn fail(&self, check: &'static str, reason: impl Into<String>) {
        self.set(check, Some(reason.into()));
    }

    /// The checks that do not hold, with their reasons.
    pub fn failing(&self) -> Vec<(&'static str, String)> {
        self.checks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|(k, v)| Some((*k, v.clone()?)))
            .collect()
    }

    /// `/readyz`'s answer: (HTTP status, body).
    pub fn readiness(&self) -> (u16, String) {
        let failing = self.failing();
        if failing.is_empty() {
            return (200, "ready\n".into());
        }
        let mut body = String::from("not ready\n");
        for (check, reason) in failing {
            body.push_str(&format!("{check}: {reason}\n"));
        }
        (503, body)
    }

    /// Each registered check as a gauge `<prefix>_not_ready{check="…"}`: 1 while it
    /// does not hold (why is in `/readyz`), 0 while it does. What an alert fires on, on
    /// any scraper, with the check that failed as its label.
    pub fn write_prometheus(&self, out: &mut crate::prom::Exposition, prefix: &str) {
        let name = format!("{prefix}_not_ready");
        let checks = self
            .checks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        out.family(
            &name,
            crate::prom::Kind::Gauge,
            "1 while the readiness check named does not hold (its reason is /readyz's), 0 while it does.",
        );
        for (check, failing) in checks {
            out.gauge(
                &name,
                &crate::prom::labels(&[("check", check)]),
                u8::from(failing.is_some()),
            );
        }
    }

    /// `/healthz`'s answer: live while it can answer at all.
    pub fn liveness(&self) -> (u16, String) {
        (200, "ok\n".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_registered_check_holds() {
        let h = Health::new();
        assert_eq!(h.readiness().0, 200, "nothing registered");
        h.fail("bus", "not yet connected to nats://127.0.0.1:4222");
        h.fail("collector", "first read pending");
        let (status, body) = h.readiness();
        assert_eq!(status, 503);
        assert_eq!(
            body,
            "not ready\nbus: not yet connected to nats://127.0.0.1:4222\ncollector: first read pending\n"
        );
        h.ok("bus");
        assert_eq!(
            h.failing(),
            vec![("collector", "first read pending".to_string())]
        );
        h.ok("collector");
        assert_eq!(h.readiness(), (200, "ready\n".to_string()));
        h.fail("bus", "disconnected");
        assert_eq!(h.readiness().0, 503);
        assert_eq!(h.liveness().0, 200);
    }
}
