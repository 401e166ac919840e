//! The wall clock and the UTC calendar: one copy for every crate. UNIX nanoseconds are
//! the time base of every record, verdict and export; dates convert with Howard
//! Hinnant's civil-from-days algorithms (proleptic Gregorian, no time zones, no leap
//! seconds), which is what RFC 3339 timestamps in logs and the audit need.

/// Nanoseconds per second.
pub const NS_PER_SEC: u64 = 1_000_000_000;

/// The wall clock, UNIX nanoseconds (0 before 1970, which a sane clock never is).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Days since 1970-01-01 of the date `y-m-d` (month and day from 1).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date (year, month, day) `days` after 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m as u32, d as u32)
}

/// `2026-05-01T12:00:00.123Z` for UNIX nanoseconds (milliseconds, UTC).
pub fn fmt_utc(ns: u64) -> String {
    let secs = ns / NS_PER_SEC;
    let millis = (ns % NS_PER_SEC) / 1_000_000;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// A figure over the current period and the one before it: it forgets what is older
/// than one or two periods, and a whole period without a sample forgets both.
#[derive(Debug, Default, Clone)]
pub struct TwoPeriods<T> {
    start: u64,
    current: T,
    previous: T,
}

impl<T: Default> TwoPeriods<T> {
    /// The current period's figure at `now`, periods of `period_ns`.
    pub fn current_at(&mut self, now: u64, period_ns: u64) -> &mut T {
        let age = now.saturating_sub(self.start);
        if age >= period_ns {
            let current = std::mem::take(&mut self.current);
            self.previous = if age >= 2 * period_ns {
                T::default()
            } else {
                current
            };
            self.start = now;
        }
        &mut self.current
    }

    pub fn current(&self) -> &T {
        &self.current
    }

    pub fn previous(&self) -> &T {
        &self.previous
    }
}

/// Another clock against this host's, learned from its time stamps as they arrive: a
/// stamp can never arrive before the moment it names, so one ahead of this clock proves
/// the other clock ahead by at least that much. The offset is the second largest amount
/// ahead over the last 2–4 s (one stray stamp does not move a whole source; stamps more
/// than a minute ahead are not a clock but a bad stamp, and are not taken), and every
/// stamp is moved back by it and never left later than its arrival. A clock *behind*
/// cannot be told from slow delivery: only the smallest delay is kept (the lag floor).
#[derive(Debug, Default, Clone)]
pub struct ClockAhead(TwoPeriods<ClockPeriod>);

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ClockPeriod {
    samples: u64,
    /// The two largest amounts a stamp was ahead of this clock (0: not ahead).
    ahead: [u64; 2],
    /// The smallest delay, arrival minus corrected stamp.
    floor: Option<u64>,
}

impl ClockAhead {
    pub const PERIOD_NS: u64 = 2 * NS_PER_SEC;
    /// Stamps further ahead than this are not a clock offset but a bad stamp (counted
    /// where they are refused).
    pub(crate) const MAX_AHEAD_NS: u64 = 60 * NS_PER_SEC;

    /// Take `stamp`, arrived at `now`; returns the stamp corrected by the offset as now
    /// estimated, never later than `now`, and whether an offset was taken off.
    pub fn observe(&mut self, stamp: u64, now: u64) -> (u64, bool) {
        let c = self.0.current_at(now, Self::PERIOD_NS);
        let ahead = stamp.saturating_sub(now);
        c.samples += 1;
        if ahead <= Self::MAX_AHEAD_NS {
            if ahead > c.ahead[0] {
                c.ahead = [ahead, c.ahead[0]];
            } else if ahead > c.ahead[1] {
                c.ahead[1] = ahead;
            }
        }
        let offset = self.ahead_ns();
        let corrected = stamp.saturating_sub(offset).min(now);
        let lag = now - corrected;
        let c = &mut self.0.current;
        c.floor = Some(c.floor.map_or(lag, |f| f.min(lag)));
        (corrected, offset > 0)
    }

    /// Stamps seen over both periods.
    pub fn samples(&self) -> u64 {
        self.0.current.samples + self.0.previous.samples
    }

    /// The estimated offset (ns ahead of this clock): the second largest amount ahead
    /// over both periods, 0 before two samples.
    pub fn ahead_ns(&self) -> u64 {
        if self.samples() < 2 {
            return 0;
        }
        let (c, p) = (&self.0.current, &self.0.previous);
        let mut all = [c.ahead[0], c.ahead[1], p.ahead[0], p.ahead[1]];
        all.sort_unstable();
        all[2]
    }

    /// The smallest delay over both periods (`None` before any stamp).
    pub fn floor_ns(&self) -> Option<u64> {
        match (self.0.current.floor, self.0.previous.floor) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_convert_both_ways() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        for days in (-800_000..800_000).step_by(97) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(
                days_from_civil(y, i64::from(m), i64::from(d)),
                days,
                "{y}-{m}-{d}"
            );
        }
    }

    #[test]
    fn utc_timestamps_have_milliseconds() {
        assert_eq!(fmt_utc(0), "1970-01-01T00:00:00.000Z");
        // date -u -d @1777636800.123 → 2026-05-01 12:00:00 UTC
        assert_eq!(
            fmt_utc(1_777_636_800_123_456_789),
            "2026-05-01T12:00:00.123Z"
        );
    }
}
