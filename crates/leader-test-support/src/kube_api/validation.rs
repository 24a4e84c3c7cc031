//! The checks of apimachinery's `staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go`
//! that the served resources apply, with the messages kube-apiserver gives, and the two ways a write
//! is refused before it reaches the store.

/// `IsQualifiedName`'s message.
pub(crate) const QUALIFIED_NAME: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')";

/// `IsValidLabelValue`'s message.
pub(crate) const LABEL_VALUE: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?'), at most 63 characters";

/// `IsValidLabelValue` (`staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go`):
/// empty, or at most 63 letters, digits, `-`, `_` and `.` that start and end with a letter or
/// digit.
pub(crate) fn is_label_value(value: &str) -> bool {
    let edge = |c: char| c.is_ascii_alphanumeric();
    value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| edge(c) || matches!(c, '-' | '_' | '.'))
            && value.starts_with(edge)
            && value.ends_with(edge))
}

/// `IsQualifiedName`: an optional prefix that is a DNS subdomain and a `/`, then a name of at
/// most 63 letters, digits, `-`, `_` and `.` that starts and ends with a letter or digit.
pub(crate) fn is_qualified_name(value: &str) -> bool {
    let name = match value.split('/').collect::<Vec<_>>()[..] {
        [name] => name,
        [prefix, name] if is_dns_subdomain(prefix) => name,
        _ => return false,
    };
    let edge = |c: char| c.is_ascii_alphanumeric();
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| edge(c) || matches!(c, '-' | '_' | '.'))
        && name.starts_with(edge)
        && name.ends_with(edge)
}

/// `IsDNS1123Subdomain`: at most 253 characters, dot-separated labels of lower-case letters,
/// digits and `-`, each starting and ending with a letter or digit
/// (`staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go`).
pub(crate) fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_dns_label_text)
}

/// A label of `IsDNS1123Label`, without its 63-character limit (which subdomains do not apply).
fn is_dns_label_text(label: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !label.is_empty()
        && label.chars().all(|c| alnum(c) || c == '-')
        && label.starts_with(alnum)
        && label.ends_with(alnum)
}

/// Why a write is refused before it reaches the store.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// 400 `BadRequest`: the body does not decode as a Lease.
    BadRequest(String),
    /// 422 `Invalid`: it decodes and fails validation.
    Invalid(String),
}
