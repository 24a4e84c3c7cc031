//! How `leader status` writes a time for people: how long ago, by this machine's clock.

use std::time::Duration;

/// `elapsed` for people: "3s ago", or, for a time ahead of this replica's clock (a writer's
/// clock ahead of ours), "3s ahead of this clock".
pub(crate) fn ago(elapsed: chrono::Duration) -> String {
    let format = |d: chrono::Duration| {
        let d = d.to_std().unwrap_or_default();
        humantime::format_duration(Duration::from_millis(
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
        ))
    };
    if elapsed < chrono::Duration::zero() {
        format!("{} ahead of this clock", format(-elapsed))
    } else {
        format!("{} ago", format(elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::ago;

    #[test]
    fn times_ahead_of_this_clock_say_so() {
        assert_eq!(ago(chrono::Duration::seconds(90)), "1m 30s ago");
        assert_eq!(ago(chrono::Duration::hours(-1)), "1h ahead of this clock");
    }
}
