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

/// Panics unless `parse` refuses each `(url, expected)` of `cases` with an error whose text
/// contains `expected` and does not show the password, which every case writes as `secret`.
pub fn assert_refused<T: std::fmt::Debug, E: std::fmt::Display>(
    parse: impl Fn(&str) -> Result<T, E>,
    cases: &[(&str, &str)],
) {
    for &(url, expected) in cases {
        let err = parse(url).expect_err(url).to_string();
        assert!(err.contains(expected), "{url}: {err}");
        assert!(!err.contains("secret"), "{url}: {err}");
    }
}

/// Panics when parsing `url` shows a part of its password: the error by its `Display` and
/// `Debug`, or the parsed URL by its description and `Debug`. The parsed URL, for more checks.
pub fn assert_parsed_hidden<P, E>(url: &str, parsed: Result<P, E>) -> Option<P>
where
    P: leader_core::LockTarget + std::fmt::Debug,
    E: std::fmt::Display + std::fmt::Debug,
{
    match parsed {
        Err(err) => {
            assert_hidden(url, &format!("{err} {err:?}"));
            None
        }
        Ok(parsed) => {
            assert_hidden(url, &format!("{} {parsed:?}", parsed.describe()));
            Some(parsed)
        }
    }
}

/// Panics when a store builder made from `url` shows a part of its password, by its `Debug`,
/// or what `build` makes of it does: the store by its `Debug`, an error by its `Display` and
/// `Debug`. The store, for more checks.
pub async fn assert_built_hidden<B, T, E>(
    url: &str,
    builder: B,
    build: impl AsyncFnOnce(B) -> Result<T, E>,
) -> Option<T>
where
    B: std::fmt::Debug,
    T: std::fmt::Debug,
    E: std::fmt::Display + std::fmt::Debug,
{
    assert_hidden(url, &format!("{builder:?}"));
    match build(builder).await {
        Ok(store) => {
            assert_hidden(url, &format!("{store:?}"));
            Some(store)
        }
        Err(err) => {
            assert_hidden(url, &format!("{err} {err:?}"));
            None
        }
    }
}

/// Panics unless `answer`, to a request made with the wrong password `secret`, is
/// [`leader_core::LockError::Forbidden`] saying "authentication failed", without showing
/// `secret` in its `Display` or `Debug`.
pub fn assert_wrong_password<T: std::fmt::Debug>(
    answer: Result<T, leader_core::LockError>,
    secret: &str,
) {
    let err = answer.expect_err("wrong password");
    assert!(
        matches!(err, leader_core::LockError::Forbidden { .. }),
        "{err:?}"
    );
    let shown = format!("{err} {err:?}");
    assert!(shown.contains("authentication failed"), "{shown}");
    assert!(
        !shown.contains(secret),
        "the error shows the password: {shown}"
    );
}
