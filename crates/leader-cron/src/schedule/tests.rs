use super::*;

fn at(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .expect("RFC 3339")
        .with_timezone(&Utc)
}

/// A firing's instant is the schedule's own, to the nanosecond, whatever fraction of a
/// second the instant searched from carries (a job's start time, a clock's reading): jobs
/// use it as their key.
#[test]
fn instants_are_whole_seconds_whatever_they_are_searched_from() {
    let zones = [
        "UTC",
        "Europe/Berlin",
        "America/New_York",
        "Australia/Sydney",
    ];
    let expressions = ["30 2 * * *", "30 2,14 * * *", "*/15 * * * *", "0 0-3 * * *"];
    for zone in zones {
        for expression in expressions {
            let schedule = Schedule::cron(expression, zone).expect("schedule");
            // Around both changes of 2027 in the zones that have them.
            for start in [
                "2027-03-27T12:00:00.012450068Z",
                "2027-10-30T12:00:00.987654321Z",
                "2027-11-06T12:00:00.5Z",
                "2027-04-03T12:00:00.25Z",
            ] {
                let mut after = at(start);
                for _ in 0..60 {
                    let next = schedule.next_after(after).expect("a next instant");
                    assert_eq!(
                        next.timestamp_subsec_nanos(),
                        0,
                        "{expression} in {zone} after {after}: {next}"
                    );
                    assert!(next > after);
                    after = next;
                }
            }
        }
    }
}

/// The first `n` instants after `from`.
fn first(schedule: &Schedule, from: &str, n: usize) -> Vec<DateTime<Utc>> {
    let mut after = at(from);
    (0..n)
        .map(|_| {
            after = schedule.next_after(after).expect("an instant");
            after
        })
        .collect()
}

/// `expression` in `zone` fires at `expected` (RFC 3339), in order, first after `from`.
fn assert_fires(expression: &str, zone: &str, from: &str, expected: &[&str]) {
    let schedule = Schedule::cron(expression, zone).expect("schedule");
    let expected: Vec<DateTime<Utc>> = expected.iter().map(|text| at(text)).collect();
    assert_eq!(
        first(&schedule, from, expected.len()),
        expected,
        "{expression} in {zone} after {from}"
    );
}

/// The documented rule holds for every expression that names wall times, lists and ranges
/// as much as single values: a wall time a spring-forward gap skips fires just after the
/// gap, once; a wall time a fall-back repeats fires once, at its first occurrence.
#[test]
fn lists_and_ranges_keep_the_daylight_saving_rule() {
    // Europe/Berlin, 2027: 02:00 CET becomes 03:00 CEST on March 28th (01:00 UTC), and
    // 03:00 CEST becomes 02:00 CET on October 31st (01:00 UTC).
    for expression in [
        "30 2 * * *",
        "30 2,14 * * *",
        "30 2-3,14 * * *",
        "0 30 2,14 * * *",
    ] {
        let berlin = Schedule::cron(expression, "Europe/Berlin").expect("schedule");
        let spring = first(&berlin, "2027-03-28T00:00:00Z", 2);
        assert_eq!(
            spring[0],
            at("2027-03-28T01:00:00Z"),
            "{expression}: {spring:?}"
        );
        assert!(
            spring[1] > at("2027-03-28T01:00:00Z"),
            "{expression}: {spring:?}"
        );
        let fall = first(&berlin, "2027-10-31T00:00:00Z", 2);
        assert_eq!(
            fall[0],
            at("2027-10-31T00:30:00Z"),
            "{expression}: {fall:?}"
        );
        assert_ne!(
            fall[1],
            at("2027-10-31T01:30:00Z"),
            "{expression} fired 02:30 twice: {fall:?}"
        );
    }
    // New York, 2027: 02:00 EST becomes 03:00 EDT on March 14th (07:00 UTC); 02:00 EDT
    // becomes 01:00 EST on November 7th (06:00 UTC).
    assert_fires(
        "15 1,2 * * *",
        "America/New_York",
        "2027-03-14T05:00:00Z",
        &["2027-03-14T06:15:00Z", "2027-03-14T07:00:00Z"],
    );
    assert_fires(
        "15 1,2 * * *",
        "America/New_York",
        "2027-11-07T04:00:00Z",
        &[
            "2027-11-07T05:15:00Z",
            "2027-11-07T07:15:00Z",
            "2027-11-08T06:15:00Z",
        ],
    );
    // A step names real instants: in both passes of a fall-back, none in a gap.
    assert_fires(
        "0 */1 * * *",
        "Europe/Berlin",
        "2027-10-30T23:30:00Z",
        &[
            "2027-10-31T00:00:00Z",
            "2027-10-31T01:00:00Z",
            "2027-10-31T02:00:00Z",
            "2027-10-31T03:00:00Z",
        ],
    );
}

#[test]
fn a_long_backlog_of_a_period_is_passed_over_to_its_last_instants() {
    let every = Schedule::every(Duration::from_secs(1)).expect("schedule");
    let (after, until) = (at("2025-01-10T00:00:00.5Z"), at("2026-01-10T00:00:00Z"));
    let (from, skipped) = every.skip_to_last(after, until, 1000).expect("a skip");
    // The walk from there sees exactly the last 1000 instants, and none is counted twice.
    let mut seen = Vec::new();
    let mut at = from;
    while let Some(next) = every.next_after(at).filter(|n| *n <= until) {
        seen.push(next);
        at = next;
    }
    assert_eq!(seen.len(), 1000);
    assert_eq!(seen.last(), Some(&until));
    assert_eq!(skipped + 1000, 365 * 24 * 3600);
    // Nothing to pass over, and expressions are walked.
    assert_eq!(every.skip_to_last(after, after, 10), None);
    assert_eq!(
        every.skip_to_last(until - chrono::Duration::seconds(5), until, 10),
        None
    );
    let cron = Schedule::cron("* * * * * *", "UTC").expect("every second");
    assert_eq!(cron.skip_to_last(after, until, 10), None);
}

#[test]
fn five_and_six_fields_in_a_zone() {
    let five = Schedule::cron("30 3 * * *", "Europe/Berlin").expect("5 fields");
    // 03:30 in Berlin in winter is 02:30 UTC.
    assert_eq!(
        five.next_after(at("2026-01-10T00:00:00Z")),
        Some(at("2026-01-10T02:30:00Z"))
    );
    let six = Schedule::cron("*/10 * * * * *", "UTC").expect("6 fields");
    assert_eq!(
        six.next_after(at("2026-01-10T00:00:05Z")),
        Some(at("2026-01-10T00:00:10Z"))
    );
    assert_eq!(five.spec(), "cron 30 3 * * * in Europe/Berlin");
    assert_eq!(Schedule::from_spec(five.spec()), Ok(five));
}

#[test]
fn bad_input_is_refused_in_one_line() {
    assert!(matches!(
        Schedule::cron("61 * * * *", "UTC"),
        Err(ScheduleError::InvalidExpression { .. })
    ));
    assert!(matches!(
        Schedule::cron("* * * *", "UTC"),
        Err(ScheduleError::InvalidExpression { .. })
    ));
    assert!(matches!(
        Schedule::cron("0 0 * * * * 2026", "UTC"),
        Err(ScheduleError::InvalidExpression { .. })
    ));
    assert_eq!(
        Schedule::cron("0 0 * * *", "Mars/Olympus"),
        Err(ScheduleError::UnknownZone {
            zone: "Mars/Olympus".into()
        })
    );
    assert!(matches!(
        Schedule::cron("0 0 30 2 *", "UTC"),
        Err(ScheduleError::NeverFires { .. })
    ));
    assert!(matches!(
        Schedule::every(Duration::from_millis(500)),
        Err(ScheduleError::BadInterval { .. })
    ));
    for err in [
        Schedule::cron("0 0 30 2 *", "UTC").expect_err("never"),
        Schedule::cron("x", "UTC").expect_err("invalid"),
    ] {
        assert!(!err.to_string().contains('\n'), "{err}");
    }
}

#[test]
fn intervals_are_aligned_to_the_epoch() {
    let every = Schedule::every(Duration::from_secs(30)).expect("every 30 s");
    assert_eq!(every.spec(), "every 30s");
    assert_eq!(
        every.next_after(at("2026-01-10T00:00:29.999Z")),
        Some(at("2026-01-10T00:00:30Z"))
    );
    assert_eq!(
        every.next_after(at("2026-01-10T00:00:30Z")),
        Some(at("2026-01-10T00:01:00Z"))
    );
    assert_eq!(Schedule::from_spec("every 30s"), Ok(every));
}

/// Europe/Berlin, 2026: clocks go from 02:00 to 03:00 on March 29th (01:00 UTC), and from
/// 03:00 back to 02:00 on October 25th (01:00 UTC).
#[test]
fn daylight_saving_gaps_and_repeats() {
    let daily = Schedule::cron("30 2 * * *", "Europe/Berlin").expect("daily");
    // The gap: 02:30 does not exist; it fires at 03:00 local, 01:00 UTC.
    assert_eq!(
        daily.next_after(at("2026-03-28T12:00:00Z")),
        Some(at("2026-03-29T01:00:00Z"))
    );
    // The repeat: 02:30 happens twice (00:30 and 01:30 UTC); it fires once, at the first.
    let first = daily.next_after(at("2026-10-24T12:00:00Z")).expect("fires");
    assert_eq!(first, at("2026-10-25T00:30:00Z"));
    assert_eq!(
        daily.next_after(first),
        Some(at("2026-10-26T01:30:00Z")),
        "not again in the second pass"
    );
    // From inside the second pass, the next firing is still the next day's.
    assert_eq!(
        daily.next_after(at("2026-10-25T01:10:00Z")),
        Some(at("2026-10-26T01:30:00Z"))
    );
    // A wildcard hour fires at each real instant, in both passes.
    let quarterly = Schedule::cron("*/15 * * * *", "Europe/Berlin").expect("quarterly");
    let mut instants = Vec::new();
    let mut t = at("2026-10-25T00:00:00Z");
    while t < at("2026-10-25T02:00:00Z") {
        t = quarterly.next_after(t).expect("fires");
        instants.push(t);
    }
    assert_eq!(
        instants.len(),
        8,
        "every 15 minutes of real time: {instants:?}"
    );
}

/// `@hourly` fires as `0 * * * *` does: in both passes of a fall-back's repeated hour; a
/// nickname's spec stays as written, so that stored states keep matching.
#[test]
fn a_nickname_fires_as_the_expression_it_stands_for() {
    let nickname = Schedule::cron("@hourly", "Europe/Berlin").expect("schedule");
    let expression = Schedule::cron("0 * * * *", "Europe/Berlin").expect("schedule");
    let fall = first(&expression, "2027-10-30T23:30:00Z", 4);
    assert_eq!(
        fall[1],
        at("2027-10-31T01:00:00Z"),
        "the second pass: {fall:?}"
    );
    assert_eq!(first(&nickname, "2027-10-30T23:30:00Z", 4), fall);
    assert_eq!(nickname.spec(), "cron @hourly in Europe/Berlin");
    assert_fires(
        "@daily",
        "Europe/Berlin",
        "2027-10-30T00:00:00Z",
        &["2027-10-30T22:00:00Z", "2027-10-31T23:00:00Z"],
    );
}

/// Two names of one zone (a link and its zone) are the same schedule; other zones, other
/// expressions and intervals are not.
#[test]
fn two_names_of_one_zone_are_the_same_schedule() {
    let cron = |expression: &str, zone: &str| Schedule::cron(expression, zone).expect("schedule");
    let new_york = cron("0 3 * * *", "America/New_York");
    assert!(new_york.same_instants(&cron("0 3 * * *", "US/Eastern")));
    assert!(cron("0 3 * * *", "UTC").same_instants(&cron("0 3 * * *", "Etc/UTC")));
    assert!(!new_york.same_instants(&cron("0 3 * * *", "America/Chicago")));
    assert!(!cron("0 3 * * *", "Europe/Berlin").same_instants(&cron("0 3 * * *", "Europe/Paris")));
    assert!(!new_york.same_instants(&cron("0 4 * * *", "US/Eastern")));
    assert!(
        !Schedule::every(Duration::from_secs(60))
            .expect("schedule")
            .same_instants(&Schedule::every(Duration::from_secs(120)).expect("schedule"))
    );
}

/// A yearly expression's instants lie a spring and an autumn apart: clocks go forward and back
/// between them, and the documented rule still holds on the night of the gap. Europe/Berlin,
/// 2030: March 31st is the last Sunday of March, when 02:00 CET becomes 03:00 CEST (01:00 UTC);
/// America/New_York, 2030: March 10th, when 02:00 EST becomes 03:00 EDT (07:00 UTC). The wall
/// time 02:30 falls in the gap and 14:30 does not: both fire, the first just after the gap,
/// each once. And in autumn, an expression with a step fires in both passes of the hour a
/// fall-back repeats (Berlin, October 31st 2027: 03:00 CEST becomes 02:00 CET at 01:00 UTC).
#[test]
fn a_yearly_list_keeps_its_gap_firing_across_a_year_of_changes() {
    assert_fires(
        "30 2,14 L 3 *",
        "Europe/Berlin",
        "2029-03-31T12:30:00Z",
        &[
            "2030-03-31T01:00:00Z",
            "2030-03-31T12:30:00Z",
            "2031-03-31T00:30:00Z",
            "2031-03-31T12:30:00Z",
        ],
    );
    assert_fires(
        "30 2 L 3 *",
        "Europe/Berlin",
        "2029-03-31T12:30:00Z",
        &["2030-03-31T01:00:00Z", "2031-03-31T00:30:00Z"],
    );
    assert_fires(
        "30 2,14 10 3 *",
        "America/New_York",
        "2029-03-10T19:30:00Z",
        &[
            "2030-03-10T07:00:00Z",
            "2030-03-10T18:30:00Z",
            "2031-03-10T06:30:00Z",
        ],
    );
    assert_fires(
        "*/30 2 L 10 *",
        "Europe/Berlin",
        "2026-10-31T01:30:00Z",
        &[
            "2027-10-31T00:00:00Z",
            "2027-10-31T00:30:00Z",
            "2027-10-31T01:00:00Z",
            "2027-10-31T01:30:00Z",
        ],
    );
}
