//! Redaction of credentials in connection strings.

/// A connection string with its password replaced by `***`, for logs and errors.
///
/// It redacts more than a URL parser would see rather than less: a password may hold `/`, `?`,
/// `#`, `@` or `:` unencoded, which ends the user-info early for a parser, so here the
/// user-info runs to the string's last `@`. A user without a password is kept where it is a
/// user name (`postgres://app@db`) and redacted elsewhere, where it may be a token
/// (`nats://TOKEN@host`). Values of secret keywords (`password=`, `token=`, ...) are
/// redacted too, in URL parameters and in key-value connection strings.
///
/// Strings that are not URLs are redacted too, since they are what errors show: a mistyped
/// scheme (`postgres:/app:pw@db`, `postgres//app:pw@db`), no scheme (`app:pw@db`) or a `://`
/// only further on hide every `user:password@` the same way, and in a key-value connection
/// string each value shaped like one (`host=app:pw@db`).
pub fn redact_url(url: &str) -> String {
    let mut secrets = keyword_values(url);
    if is_key_value(url) {
        secrets.extend(value_user_infos(url));
    } else {
        secrets.extend(user_info_secret(url, true));
    }
    secrets.sort_unstable();
    let mut out = String::with_capacity(url.len());
    // Where the last `***` ends.
    let mut redacted_to: Option<usize> = None;
    for (start, end) in secrets {
        match redacted_to {
            // Overlaps or touches the secret before: one `***` for both.
            Some(to) if start <= to => redacted_to = Some(to.max(end)),
            _ => {
                out.push_str(&url[redacted_to.unwrap_or(0)..start]);
                out.push_str("***");
                redacted_to = Some(end);
            }
        }
    }
    out.push_str(&url[redacted_to.unwrap_or(0)..]);
    out
}

/// The schemes in which a user-info without `:` is a user name, shown; in any other it may be a
/// token, and is redacted whole.
const USER_NAME_SCHEMES: [&str; 6] = [
    "postgres",
    "postgresql",
    "mysql",
    "mariadb",
    "etcd",
    "etcds",
];

/// Whether `name` is a URL scheme: a letter, then letters, digits, `+`, `-` or `.`.
fn is_scheme(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
}

/// Where the user-info of `url` would start, and the scheme before it when there is one: after
/// `scheme://` in a URL; in anything else after a scheme-like word and `:/`, `//`, `:\\` (a
/// mistyped `://`), or at the start.
fn user_info_start(url: &str) -> (usize, Option<&str>) {
    if let Some((scheme, _)) = url.split_once("://")
        && is_scheme(scheme)
    {
        return (scheme.len() + 3, Some(scheme));
    }
    let body = url.trim_start();
    let offset = url.len() - body.len();
    let name_len = body
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .unwrap_or(body.len());
    let after = &body[name_len..];
    let colon = usize::from(after.starts_with(':'));
    let slashes = after[colon..]
        .find(|c: char| !matches!(c, '/' | '\\'))
        .unwrap_or(after.len() - colon);
    if slashes == 0 {
        return (offset, None);
    }
    let name = &body[..name_len];
    (
        offset + name_len + colon + slashes,
        is_scheme(name).then_some(name),
    )
}

/// The byte range of the password in `url`, if it has a user-info. A user-info without `:`
/// and without a scheme saying what it is counts as a secret when `lone_is_secret`.
fn user_info_secret(url: &str, lone_is_secret: bool) -> Option<(usize, usize)> {
    let (start, scheme) = user_info_start(url);
    // Never under-redact: the user-info runs to the LAST `@`, the password from its first `:`.
    let at = url.rfind('@').filter(|&at| at >= start)?;
    let user_name = match scheme {
        Some(scheme) => USER_NAME_SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()),
        None => !lone_is_secret,
    };
    match url[start..at].find(':') {
        Some(colon) => Some((start + colon + 1, at)),
        None if user_name => None,
        None => Some((start, at)),
    }
}

/// Whether `conn` is a key-value connection string (`host=db user=app`): it starts with a
/// parameter's name and `=`.
fn is_key_value(conn: &str) -> bool {
    let body = conn.trim_start();
    let name_len = body
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(body.len());
    name_len > 0
        && body[name_len..]
            .trim_start_matches([' ', '\t'])
            .starts_with('=')
}

/// The passwords of the values of key-value string `conn` written as `user:password@host` or as
/// URLs. A lone `user@host` there is a user name (`user=app@server`), kept.
fn value_user_infos(conn: &str) -> Vec<(usize, usize)> {
    let mut ranges = Vec::new();
    let mut word_start = 0;
    for word in conn.split([' ', '\t']) {
        let value_start = word
            .find('=')
            .filter(|&eq| {
                word[..eq]
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_')
            })
            .map_or(0, |eq| eq + 1);
        let value = word[value_start..].trim_matches('\'');
        let offset = word_start + value_start + word[value_start..].find(value).unwrap_or(0);
        if let Some((start, end)) = user_info_secret(value, false) {
            ranges.push((offset + start, offset + end));
        }
        word_start += word.len() + 1;
    }
    ranges
}

/// The names whose values are credentials, in key-value connection strings and URL query
/// parameters (`password=`, an ACL `token=`, a `secret=`, a SAS `sig=`, a signed URL's
/// `X-Amz-Signature=`), also at the end of a longer name (`aws_secret_access_key=`,
/// `sas_token=`).
const SECRET_KEYWORDS: [&str; 10] = [
    "password",
    "passwd",
    "pass",
    "pwd",
    "token",
    "secret",
    "key",
    "sig",
    "signature",
    "credential",
];

/// The byte ranges of the values of [`SECRET_KEYWORDS`] in `conn`.
fn keyword_values(conn: &str) -> Vec<(usize, usize)> {
    let lower = conn.to_ascii_lowercase();
    let mut ranges = Vec::new();
    for keyword in SECRET_KEYWORDS {
        let mut search = 0;
        while let Some(found) = lower[search..].find(keyword) {
            let start = search + found;
            search = start + keyword.len();
            // The keyword ends a parameter's name: `token=`, also `sas_token=` or
            // `aws_secret_access_key=`, and `password = x` in a key-value string.
            let name_start = conn[..start]
                .rfind([' ', '?', '&', '\t'])
                .map_or(0, |b| b + 1);
            let boundary = conn[name_start..start]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            let after_name = conn[search..].trim_start_matches([' ', '\t']);
            let Some(value) = after_name.strip_prefix('=').filter(|_| boundary) else {
                continue;
            };
            let value = value.trim_start_matches([' ', '\t']);
            let value_start = conn.len() - value.len();
            let value_end = value_start + value_len(value);
            ranges.push((value_start, value_end));
            search = value_end.max(search);
        }
    }
    ranges
}

/// The length of the value `value` starts with: up to a space, tab or `&`, or a quoted value
/// (`'it''s'`, `'a\'b'`) up to its closing quote.
fn value_len(value: &str) -> usize {
    let Some(quoted) = value.strip_prefix('\'') else {
        return value.find([' ', '&', '\t']).unwrap_or(value.len());
    };
    let mut escaped = false;
    for (i, c) in quoted.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '\'' => return i + 2,
            _ => {}
        }
    }
    value.len()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::redact_url;

    /// Each input redacts to its expected text.
    fn assert_redacts(cases: &[(&str, &str)]) {
        for (input, redacted) in cases {
            assert_eq!(redact_url(input), *redacted, "{input}");
        }
    }

    proptest! {
        /// Whatever the password holds, all of it and nothing else is redacted.
        #[test]
        fn redact_any_password(
            scheme in "(postgres|mysql|redis|nats|etcd|s3)",
            user in "[a-z0-9_.-]{0,8}",
            password in "[^=]{0,24}",
            host in "[a-z0-9.-]{1,12}(:[0-9]{1,5})?(,[a-z0-9.-]{1,12})?",
            rest in "([/?#][^@=]{0,24})?",
        ) {
            let url = format!("{scheme}://{user}:{password}@{host}{rest}");
            prop_assert_eq!(redact_url(&url), format!("{scheme}://{user}:***@{host}{rest}"));
        }

        /// The same with `://` mistyped: the password is redacted all the same.
        #[test]
        fn redact_any_password_after_a_mistyped_scheme(
            scheme in "(postgres|mysql|redis|nats|etcd|s3)",
            separator in r"(:/|//|:\\\\|/|:///| //| )",
            user in "[a-z0-9_.-]{0,8}",
            password in "[^=]{0,24}",
            host in "[a-z0-9.-]{1,12}(:[0-9]{1,5})?(,[a-z0-9.-]{1,12})?",
            rest in "([/?#][^@=]{0,24})?",
        ) {
            let url = format!("{scheme}{separator}{user}:{password}@{host}{rest}");
            prop_assert_eq!(
                redact_url(&url),
                format!("{scheme}{separator}{user}:***@{host}{rest}")
            );
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cr%40t@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(
            redact_url("postgres://db/x?user=a&password=hunter2&sslmode=require"),
            "postgres://db/x?user=a&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("host=db password=hunter2 user=a"),
            "host=db password=*** user=a"
        );
        assert_eq!(redact_url("host=db user=a"), "host=db user=a");
        assert_eq!(redact_url("postgres://a:b@c@db/x"), "postgres://a:***@db/x");
        assert_eq!(redact_url("redis://:pw@h:6379/2"), "redis://:***@h:6379/2");
        assert_eq!(redact_url("rediss://app:pw@h"), "rediss://app:***@h");
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        assert_eq!(
            redact_url("consul://h:8500/?dc=a&token=abc-123"),
            "consul://h:8500/?dc=a&token=***"
        );
        assert_eq!(
            redact_url("s3://b/k?secret=x&key=y"),
            "s3://b/k?secret=***&key=***"
        );
        assert_eq!(
            redact_url("s3://b/k/?aws_secret_access_key=x&region=eu&sas_token=y&sig=z"),
            "s3://b/k/?aws_secret_access_key=***&region=eu&sas_token=***&sig=***"
        );
    }

    /// A password holding a character that ends the user-info for a URL parser is redacted
    /// whole, raw or percent-encoded.
    #[test]
    fn redact_passwords_holding_url_delimiters() {
        assert_redacts(&[
            ("mysql://u:se/cret@h/x", "mysql://u:***@h/x"),
            ("postgres://u:a?b@h/db", "postgres://u:***@h/db"),
            ("redis://:p#w@h:6379", "redis://:***@h:6379"),
            ("redis://:p@w@h:6379", "redis://:***@h:6379"),
            ("nats://u:p:w@h", "nats://u:***@h"),
            ("postgres://u:a/b?c#d@e:f@h/db", "postgres://u:***@h/db"),
            ("postgres://u:se%2Fcret@h/db", "postgres://u:***@h/db"),
            (
                "etcd://u:p/w@h1:2379,h2:2379/",
                "etcd://u:***@h1:2379,h2:2379/",
            ),
            // The last `@` ends the user-info, even in the path or the parameters.
            ("postgres://u:pw@h/db?x=a@b", "postgres://u:***@b"),
            ("postgres://h:5432/db?x=a@b", "postgres://h:***@b"),
        ]);
    }

    /// A user-info without a password is a token except in the schemes of database users.
    #[test]
    fn redact_a_lone_user_info_where_it_may_be_a_token() {
        assert_redacts(&[
            ("nats://s3cret@h:4222", "nats://***@h:4222"),
            ("nats://tok/en@h", "nats://***@h"),
            ("redis://s3cret@h", "redis://***@h"),
            (
                "https://ghp_s3cret@example.com/x",
                "https://***@example.com/x",
            ),
            ("mysql://app@db/x", "mysql://app@db/x"),
            ("etcd://root@a:2379,b:2379", "etcd://root@a:2379,b:2379"),
            ("nats://h1:4222,nats://s3cret@h2", "nats://h1:***@h2"),
        ]);
    }

    /// Strings that are not URLs, whatever went wrong around `://`, keep no `user:password@`.
    #[test]
    fn redact_passwords_of_strings_that_are_not_urls() {
        assert_redacts(&[
            ("postgres:/app:pw@db/x", "postgres:/app:***@db/x"),
            ("postgres//app:pw@db/x", "postgres//app:***@db/x"),
            ("postgres:\\\\app:pw@db", "postgres:\\\\app:***@db"),
            ("postgres:///app:pw@db", "postgres:///app:***@db"),
            ("postgres:app:pw@db/x", "postgres:***@db/x"),
            ("postgres::/app:pw@db", "postgres:***@db"),
            ("postgres:/ app:pw@db", "postgres:/ app:***@db"),
            (" postgres://app:pw@db", " postgres://app:***@db"),
            ("://app:pw@db", "://app:***@db"),
            ("app:pw@db:5432/x", "app:***@db:5432/x"),
            ("app:p@w/d:x@db", "app:***@db"),
            ("redis:/:pw@h:6379", "redis:/:***@h:6379"),
            ("pw@db", "***@db"),
            ("nats:/tok@h", "nats:/***@h"),
            ("postgres:/app@db", "postgres:/app@db"),
            // A `://` further on is no scheme: it is in the password, the path or a value.
            ("app:pw@db?next=http://x", "app:***@db?next=http://x"),
            ("postgres:/app:pw@db://x", "postgres:/app:***@db://x"),
            ("app:p://w@db", "app:***@db"),
            ("db:5432/x", "db:5432/x"),
            ("nonsense", "nonsense"),
        ]);
    }

    /// In a key-value connection string, a value shaped `user:password@host` or a URL loses its
    /// password; a user name holding `@` stays.
    #[test]
    fn redact_user_infos_in_key_value_values() {
        assert_redacts(&[
            (
                "host=db user=app@server password=pw",
                "host=db user=app@server password=***",
            ),
            ("host=app:pw@db user=a", "host=app:***@db user=a"),
            (
                "dbname=postgres://app:pw@db/x sslmode=require",
                "dbname=postgres://app:***@db/x sslmode=require",
            ),
            ("host='app:pw@db' user=a", "host='app:***@db' user=a"),
            (
                "host=db\tservice=nats://tok@h",
                "host=db\tservice=nats://***@h",
            ),
            ("host = app:pw@db", "host = app:***@db"),
        ]);
    }

    /// Redactions that overlap are one: a parameter's value holding `@` is hidden with the
    /// user-info that ends there.
    #[test]
    fn redact_overlapping_secrets_once() {
        assert_redacts(&[
            ("s3://b/x/?sig=p4ss@w0rd", "s3://***"),
            (
                "postgres://h/db?password=p4ss@w0rd",
                "postgres://h/db?password=***",
            ),
            ("redis://:p?secret=x@y@h", "redis://:***"),
            ("postgres://h:1/db?password=a@b&x=1", "postgres://h:***&x=1"),
        ]);
    }

    /// Key-value connection strings: spaces around `=` and quoted values.
    #[test]
    fn redact_key_value_passwords_however_written() {
        assert_redacts(&[
            (
                "host=db password = hunter2 user=a",
                "host=db password = *** user=a",
            ),
            (
                "host=db password='se cret' user=a",
                "host=db password=*** user=a",
            ),
            (
                r"host=db password='it\'s secret' user=a",
                "host=db password=*** user=a",
            ),
            ("host=db password='unterminated x", "host=db password=***"),
            (
                "host=db passwd=x pwd=y pass=z",
                "host=db passwd=*** pwd=*** pass=***",
            ),
            (
                "s3://b/k?X-Amz-Signature=abc&X-Amz-Credential=AKID",
                "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***",
            ),
            (
                "host=db keyword=x monkey_id=y",
                "host=db keyword=x monkey_id=y",
            ),
        ]);
    }
}
