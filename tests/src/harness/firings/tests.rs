use super::given_up;

#[test]
fn given_up_firings_are_read_from_the_replicas_logs() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("f0.1.stderr"),
        "2026-11-28T16:49:10.1Z  WARN a firing whose leader died before it ended runs again schedule=s scheduled=2026-11-28 16:49:08 UTC attempt=2\n\
         2026-11-28T16:49:12.2Z  WARN a firing is given up schedule=s scheduled=2026-11-28 16:49:09 UTC reason=its leader died before it ended, 3 attempts in all\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("f1.1.stderr"),
        "2026-11-28T16:49:13.2Z  WARN a firing is given up schedule=s scheduled=2026-11-28 16:49:09.138 UTC reason=its leader died before it ended\n",
    )
    .expect("write");
    let seen: Vec<String> = given_up(dir.path())
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        seen,
        ["2026-11-28 16:49:09 UTC", "2026-11-28 16:49:09.138 UTC"]
    );
}
