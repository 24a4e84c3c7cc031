//! The keys Consul's KV endpoint serves, checked when the store and the lock are built.
//!
//! Consul checks key names on `GET`, `PUT` and `DELETE /v1/kv/KEY` (`validateKVKey` in
//! `agent/kvs_endpoint.go`) but not in transactions (`/v1/txn`), which is how the lock
//! writes: a key it could write but no client could read. So the lock refuses such names when
//! it is built, and never maps them to other keys (two names mapped to one key would share
//! it).

use leader_core::LockError;

use crate::error::BACKEND;

/// Where the lock keeps the holder's renewals: `KEY` + this (`leader/nightly/.renewal`).
/// Election names have no segment starting with `.`, so no election's key is another's
/// renewal key.
pub(crate) const RENEWAL_SUFFIX: &str = "/.renewal";

/// The endings `validateKVKey` refuses ("may be cached by proxies"), compared without case.
const REFUSED_EXTENSIONS: &[&str] = &[
    ".js", ".css", ".html", ".htm", ".xml", ".json", ".txt", ".log", ".php", ".asp", ".jsp",
    ".cgi", ".pl", ".py", ".rb", ".sh", ".exe", ".dll", ".bat", ".cmd", ".com", ".scr", ".vbs",
    ".pdf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".zip", ".rar", ".tar", ".gz",
    ".7z", ".bz2", ".jpg", ".jpeg", ".png", ".gif", ".svg", ".ico", ".bmp", ".mp3", ".mp4", ".avi",
    ".mov", ".wmv", ".flv", ".swf", ".woff", ".woff2", ".ttf", ".eot", ".otf",
];

/// The characters `validateKVKey` allows.
fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, ',' | '-' | '_' | '.' | '/')
}

/// Why Consul would refuse or misplace the key `key`, if it would: a character other than
/// letters, digits and `,-_./`, a leading `/`, an empty, `.` or `..` segment (Consul's HTTP
/// server answers a path with those with a redirect to its cleaned form: another key), or one
/// of the endings `validateKVKey` refuses.
fn refusal(key: &str) -> Option<String> {
    if let Some(c) = key.chars().find(|c| !allowed(*c)) {
        return Some(format!(
            "it holds {c:?}; Consul's KV API allows letters, digits and ,-_./ only"
        ));
    }
    if key.starts_with('/') {
        return Some("it starts with '/'".to_owned());
    }
    let segments: Vec<&str> = key.split('/').collect();
    // A trailing '/' ends a prefix, not a key.
    let inner = &segments[..segments.len().saturating_sub(1)];
    if inner.iter().any(|s| s.is_empty()) {
        return Some("it holds \"//\"".to_owned());
    }
    if segments.iter().any(|s| *s == "." || *s == "..") {
        return Some("it holds a '.' or '..' segment".to_owned());
    }
    let lower = key.to_ascii_lowercase();
    REFUSED_EXTENSIONS
        .iter()
        .find(|ext| lower.ends_with(*ext))
        .map(|ext| format!("it ends in {ext:?}, an ending Consul's KV API refuses"))
}

/// Refuses a key prefix Consul would refuse (see [`refusal`]).
pub(crate) fn check_prefix(prefix: &str) -> Result<(), LockError> {
    match refusal(prefix) {
        None => Ok(()),
        Some(why) => Err(LockError::Misconfigured {
            backend: BACKEND,
            message: format!("the key prefix {prefix:?} cannot be used: {why}"),
        }),
    }
}

/// Refuses an election name whose key (`prefix` + `name`) Consul would refuse or misplace,
/// naming the rule and a name that would do.
pub(crate) fn check_name(prefix: &str, name: &str) -> Result<(), LockError> {
    let key = format!("{prefix}{name}");
    let why = if name.is_empty() {
        Some("it is empty".to_owned())
    } else if name.ends_with('/') {
        Some("it ends in '/'".to_owned())
    } else if let Some(why) = refusal(&key) {
        Some(why)
    } else if name.split('/').any(|s| s.starts_with('.')) {
        Some(format!(
            "a segment of it starts with '.', which is kept for the lock's renewals (KEY{RENEWAL_SUFFIX})"
        ))
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => {
            let suggestion = suggest(name);
            let hint = if suggestion.is_empty() || suggestion == name {
                String::new()
            } else {
                format!("; {suggestion:?} would do")
            };
            Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "the election name {name:?} (Consul key {key:?}) cannot be used: {why}{hint}"
                ),
            })
        }
    }
}

/// The nearest name that passes: other characters as `-`, segments without leading dots or
/// empty ones, and a refused ending's dot as `-`.
fn suggest(name: &str) -> String {
    let replaced: String = name
        .chars()
        .map(|c| if allowed(c) { c } else { '-' })
        .collect();
    let mut name = replaced
        .split('/')
        .map(|s| s.trim_start_matches('.'))
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("/");
    let lower = name.to_ascii_lowercase();
    if let Some(ext) = REFUSED_EXTENSIONS.iter().find(|ext| lower.ends_with(*ext)) {
        let at = name.len() - ext.len();
        name.replace_range(at..=at, "-");
    }
    name
}

/// Percent-encodes a key for the URL path, keeping its slashes.
pub(crate) fn encode_key(key: &str) -> String {
    let mut encoded = String::with_capacity(key.len());
    for byte in key.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_./".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_consul_serves_pass() {
        for name in [
            "nightly",
            "jobs/nightly",
            "a,b",
            "v1.2-x_y",
            "a..b",
            "job.jsonl",
        ] {
            assert!(check_name("leader/", name).is_ok(), "{name}");
        }
        for prefix in ["", "leader/", "apps/team-a/", "leader-"] {
            assert!(check_prefix(prefix).is_ok(), "{prefix:?}");
        }
    }

    #[test]
    fn names_consul_refuses_are_refused_with_a_name_that_would_do() {
        for (name, nearest) in [
            ("job.json", "job-json"),
            ("a~b", "a-b"),
            ("report.PDF", "report-PDF"),
            ("x/../y", "x/y"),
            ("jobs//x", "jobs/x"),
            (".hidden", "hidden"),
            ("a b", "a-b"),
            ("example.com", "example-com"),
        ] {
            let err = check_name("leader/", name).expect_err(name).to_string();
            assert!(err.contains(&format!("{nearest:?} would do")), "{err}");
            assert!(check_name("leader/", nearest).is_ok(), "{nearest}");
        }
        for name in ["", "jobs/", "x/.renewal"] {
            assert!(check_name("leader/", name).is_err(), "{name:?}");
        }
        for prefix in ["/leader/", "le ader/", "a//b/", "a/../b/"] {
            assert!(check_prefix(prefix).is_err(), "{prefix:?}");
        }
    }
}
