//! Redaction of credentials in connection strings.

/// A connection string with its password replaced by `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let redacted = redact_keyword_password(url);
    let Some(scheme_end) = redacted.find("://") else {
        return redacted;
    };
    let rest = &redacted[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return redacted;
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return redacted;
    };
    format!(
        "{}{}:***{}",
        &redacted[..scheme_end + 3],
        &userinfo[..colon],
        &redacted[scheme_end + 3 + at..]
    )
}

/// The keywords whose values are credentials, in key-value connection strings and URL query
/// parameters (`password=`, an ACL `token=`, a `secret=`, a SAS `sig=`), also at the end of a
/// longer name (`aws_secret_access_key=`, `sas_token=`).
const SECRET_KEYWORDS: [&str; 6] = [
    "password=",
    "token=",
    "secret=",
    "access_key=",
    "key=",
    "sig=",
];

/// Redacts the values of [`SECRET_KEYWORDS`] in key-value connection strings and URL query
/// parameters.
fn redact_keyword_password(conn: &str) -> String {
    let mut redacted = conn.to_owned();
    for keyword in SECRET_KEYWORDS {
        redacted = redact_keyword(&redacted, keyword);
    }
    redacted
}

fn redact_keyword(conn: &str, keyword: &str) -> String {
    let lower = conn.to_ascii_lowercase();
    let mut out = String::with_capacity(conn.len());
    let mut rest = 0;
    let mut search = 0;
    while let Some(found) = lower[search..].find(keyword) {
        let start = search + found;
        // The keyword ends a parameter's name: `token=`, also `sas_token=` or
        // `aws_secret_access_key=`.
        let name_start = conn[..start]
            .rfind([' ', '?', '&', '\t'])
            .map_or(0, |b| b + 1);
        let boundary = conn[name_start..start]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        let value_start = start + keyword.len();
        if !boundary {
            search = value_start;
            continue;
        }
        let value_end = conn[value_start..]
            .find([' ', '&', '\t'])
            .map_or(conn.len(), |end| value_start + end);
        out.push_str(&conn[rest..value_start]);
        out.push_str("***");
        rest = value_end;
        search = value_end;
    }
    out.push_str(&conn[rest..]);
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

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
}
