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
