//! Passwords holding the characters a URL gives a meaning to, for the tests that check that no
//! error, description or `Debug` shows a password, however it is written in a URL.

/// The parts of every password of [`passwords`]; none may show anywhere (compared ignoring
/// case: a URL parser lowercases what it takes for a host).
pub const MARKERS: [&str; 3] = ["p4ss", "w0rd", "54321"];

/// The characters that end or split a URL's user-info when unencoded, and their encodings.
const DELIMITERS: [(char, &str); 5] = [
    ('/', "%2F"),
    ('?', "%3F"),
    ('#', "%23"),
    ('@', "%40"),
    (':', "%3A"),
];

/// Passwords as written in a URL: `p4ss` and `54321` (which a parser takes for a port when
/// the user-info ends early) joined to `w0rd` by each of `/`, `?`, `#`, `@` and `:`, raw and
/// percent-encoded, and by all of them at once.
pub fn passwords() -> Vec<String> {
    let mut passwords = Vec::new();
    for (raw, encoded) in DELIMITERS {
        for start in ["p4ss", "54321"] {
            passwords.push(format!("{start}{raw}w0rd"));
            passwords.push(format!("{start}{encoded}w0rd"));
        }
    }
    passwords.push("p4ss/?#@:w0rd".to_owned());
    passwords.push("p4ss%2F%3F%23%40%3Aw0rd".to_owned());
    passwords
}

/// [`passwords`] that can stand alone as a user-info (`nats://TOKEN@host`): those without a raw
/// `:`, which would end a user name and start a password.
pub fn tokens() -> Vec<String> {
    passwords()
        .into_iter()
        .filter(|password| !password.contains(':'))
        .collect()
}

/// Whether `text` (an error, a description, a `Debug`) shows a part of a password of
/// [`passwords`].
pub fn shows_password(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    MARKERS.iter().any(|marker| lower.contains(marker))
}

/// Panics when `text` shows a part of the password of `url`.
pub fn assert_hidden(url: &str, text: &str) {
    assert!(
        !shows_password(text),
        "{url}: the password shows in {text:?}"
    );
}
