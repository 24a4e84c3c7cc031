//! The built `leader` command never prints the password of its lock URL: not in `--help`
//! (where clap shows the environment's values), not when the URL is malformed, for any
//! subcommand that takes `--lock`.

use std::process::{Command, Output, Stdio};

const LEADER: &str = env!("CARGO_BIN_EXE_leader");

/// The parts of every password below; none may show anywhere (compared ignoring case).
const MARKERS: [&str; 2] = ["p4ss", "w0rd"];

/// Passwords holding the characters a URL gives a meaning to, raw and percent-encoded.
const PASSWORDS: [&str; 8] = [
    "p4ss-w0rd",
    "p4ss/w0rd",
    "p4ss@w0rd",
    "p4ss:w0rd",
    "p4ss+w0rd&x=y",
    "p4ss%2Fw0rd",
    "p4ss%40w0rd",
    "p4ss/?#@:w0rd",
];

/// Whether `output` shows a part of a password.
fn shows_password(output: &Output) -> bool {
    let text = format!(
        "{} {}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
    .to_ascii_lowercase();
    MARKERS.iter().any(|marker| text.contains(marker))
}

/// Runs `leader ARGS` with `LEADER_LOCK` set to `lock` (or unset), and nothing else of the
/// caller's `LEADER_*` settings.
fn leader(args: &[&str], lock: Option<&str>) -> Output {
    let mut command = Command::new(LEADER);
    command
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("LEADER_NAME")
        .stdin(Stdio::null());
    match lock {
        Some(lock) => command.env("LEADER_LOCK", lock),
        None => command.env_remove("LEADER_LOCK"),
    };
    command.output().expect("run leader")
}

/// Every help that lists `--lock`, long and short.
fn helps() -> Vec<&'static [&'static str]> {
    let mut helps: Vec<&[&str]> = vec![
        &["run", "--help"],
        &["run", "-h"],
        &["help", "run"],
        &["status", "--help"],
        &["handover", "--help"],
        &["shards", "resize", "--help"],
        &["shards", "drain", "--help"],
        &["shards", "undrain", "-h"],
    ];
    if cfg!(feature = "cron") {
        helps.extend::<[&[&str]; 5]>([
            &["cron", "--help"],
            &["cron", "suspend", "--help"],
            &["cron", "resume", "-h"],
            &["cron", "trigger", "--help"],
            &["cron", "cancel", "--help"],
        ]);
    }
    helps
}

#[test]
fn help_names_leader_lock_but_never_shows_its_value() {
    for password in PASSWORDS {
        let lock = format!("postgres://app:{password}@db:5432/app");
        for args in helps() {
            let output = leader(args, Some(&lock));
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert!(output.status.success(), "leader {args:?}: {output:?}");
            assert!(stdout.contains("LEADER_LOCK"), "leader {args:?}: {stdout}");
            assert!(
                !shows_password(&output),
                "leader {args:?} with LEADER_LOCK={lock} shows the password: {stdout}"
            );
        }
    }
}

/// Lock URLs mistyped around `://`, with `password`: never URLs to a parser, yet each holds a
/// `user:password@host` that must not show.
fn malformed(password: &str) -> Vec<String> {
    vec![
        format!("postgres:/app:{password}@db/app"),
        format!("postgres//app:{password}@db/app"),
        format!("postgres:app:{password}@db/app"),
        format!("postgres:\\\\app:{password}@db/app"),
        format!("postgres:/ app:{password}@db/app"),
        format!("redis:/:{password}@cache:6379"),
        format!("app:{password}@db/app"),
        format!(" postgres://app:{password}@db/app"),
        format!("app:{password}@db/app?next=http://x"),
        format!("postgres:/app:{password}@db://x"),
    ]
}

#[test]
fn malformed_lock_urls_are_refused_without_their_password() {
    for password in PASSWORDS {
        for lock in malformed(password) {
            for output in [
                leader(&["status", "--name", "jobs", "--lock", &lock], None),
                leader(&["run", "--name", "jobs", "--", "true"], Some(&lock)),
            ] {
                let stderr = String::from_utf8_lossy(&output.stderr);
                assert_eq!(output.status.code(), Some(3), "{lock}: {stderr}");
                assert!(stderr.contains("lock URL"), "{lock}: {stderr}");
                assert!(
                    !shows_password(&output),
                    "{lock}: the password shows in {stderr}"
                );
            }
        }
    }
}
