use super::*;

fn start(identity: &str, token: u64, at: i128, pid: i32) -> TermEvent {
    TermEvent {
        start: true,
        identity: identity.into(),
        token,
        at,
        pid: Some(pid),
    }
}

fn stop(identity: &str, token: u64, at: i128) -> TermEvent {
    TermEvent {
        start: false,
        identity: identity.into(),
        token,
        at,
        pid: None,
    }
}

const MS: i128 = 1_000_000;

fn freeze(pids: &[i32], stopped_ms: i128, thawed_ms: i128) -> Freeze {
    Freeze {
        pids: pids.iter().copied().collect(),
        stopped: stopped_ms * MS,
        thawed: thawed_ms * MS,
    }
}

/// A term whose COMMAND was in a frozen group is marked at the first freeze after its
/// start, though its log had no start line when the freeze read it; an earlier mark stays;
/// a freeze after the term stopped or was killed does not count, nor one long before its
/// start (a process that had its pid before). A start line written just after a thaw by a
/// process of the freeze is moved to the freeze; one written during it is a freeze that
/// missed its process.
#[test]
fn freezes_mark_terms_by_process() {
    let mut events = [
        start("a", 1, 100 * MS, 7),
        start("b", 2, 5_000 * MS, 8),
        start("a", 3, 3_000 * MS, 9),
        start("c", 4, 100 * MS, 10),
        stop("c", 4, 200 * MS),
        start("d", 5, 100 * MS, 11),
        start("e", 6, 2_500 * MS, 12),
        start("f", 7, 4_100 * MS, 13),
    ];
    let freezes = [
        freeze(&[7, 9], 300, 480),
        freeze(&[7, 9], 3_600, 3_780),
        freeze(&[8], 50, 230),
        freeze(&[10, 11], 900, 1_080),
        freeze(&[12], 2_000, 2_180),
        freeze(&[13], 4_000, 4_180),
    ];
    let mut frozen = Marks::new();
    frozen.insert(("a".into(), 3), 3_550 * MS);
    let killed = Marks::from([(("d".into(), 5), 400 * MS)]);
    let missed = mark_frozen_by_pid(&mut events, &freezes, &killed, &mut frozen);
    // Each term's mark (ms), if any, and why.
    let marks = [
        ("a", 1, Some(300), "frozen while it ran"),
        ("b", 2, None, "frozen long before it started"),
        ("a", 3, Some(3_550), "the earlier mark stays"),
        ("c", 4, None, "its pid frozen after it stopped"),
        ("d", 5, None, "its pid frozen after it was killed"),
        ("e", 6, Some(2_000), "frozen before it wrote its start line"),
        ("f", 7, None, "a freeze that missed its process"),
    ];
    for (identity, token, marked_ms, why) in marks {
        assert_eq!(
            frozen.get(&(identity.into(), token)),
            marked_ms.map(|ms| ms * MS).as_ref(),
            "{identity} (token {token}): {why}"
        );
    }
    assert_eq!(events[6].at, 2_000 * MS, "its start moved to the freeze");
    assert_eq!(missed.len(), 1, "{missed:?}");
    assert!(missed[0].starts_with("f (token 7)"), "{missed:?}");
}

/// Two terms of a shard as a freeze left them: the earlier one's COMMAND was frozen while
/// it started, wrote its start line once resumed, after the next term had begun, and was
/// killed at once. Its term ends at the freeze; without the move its late start line would
/// read as an overlap and a token that went down.
#[test]
fn a_command_frozen_while_starting_acts_as_a_frozen_term() {
    let events = vec![
        start("s2.8", 65, 2_000 * MS, 1443),
        start("s0.8", 64, 2_810 * MS, 1270),
        stop("s2.8", 65, 3_000 * MS),
    ];
    let freezes = [freeze(&[1268, 1270], 1_000, 2_800)];
    let gone = Marks::from([(("s0.8".into(), 64), 2_816 * MS)]);
    let check = |events: &[TermEvent], frozen: &Marks| {
        checker::check(&checker::terms_seen(events, &Marks::new(), frozen, &gone))
    };
    let (overlaps, _) = check(&events, &Marks::new());
    assert_eq!(overlaps, 1, "the late start line alone reads as an overlap");

    let mut events = events;
    let mut frozen = Marks::new();
    let missed = mark_frozen_by_pid(&mut events, &freezes, &Marks::new(), &mut frozen);
    assert!(missed.is_empty(), "{missed:?}");
    assert_eq!(frozen.get(&("s0.8".into(), 64)), Some(&(1_000 * MS)));
    assert_eq!(check(&events, &frozen), (0, Vec::new()));
}

/// A write is stale when the sink accepted it after a term with a higher token had started,
/// but a frozen term's write after its freeze is the fence's to judge: accepted only before
/// the next term's first write.
#[test]
fn writes_resumed_after_a_freeze_are_judged_by_the_fence() {
    let starts = [start("s0", 400, 100, 1), start("s1", 401, 300, 2)];
    assert_eq!(
        judge_write(400, 120, true, &starts, Some(150)),
        Judged::Fine
    );
    assert_eq!(judge_write(401, 305, true, &starts, None), Judged::Fine);
    assert_eq!(
        judge_write(400, 320, true, &starts, Some(150)),
        Judged::Resumed
    );
    assert_eq!(
        judge_write(400, 320, true, &starts, None),
        Judged::Stale(401),
        "a term never frozen that wrote after the next began"
    );
    assert_eq!(
        judge_write(400, 320, true, &starts, Some(330)),
        Judged::Stale(401),
        "written before its freeze"
    );
    assert_eq!(
        judge_write(400, 340, false, &starts, Some(150)),
        Judged::Refused
    );
}
