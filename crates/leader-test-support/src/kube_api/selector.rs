//! Label selectors as a list or a watch takes them (`?labelSelector=`), parsed and matched as
//! `staging/src/k8s.io/apimachinery/pkg/labels/selector.go` (`Parse`, `Requirement.Matches`)
//! does: requirements separated by commas, all of which must hold.

use serde_json::Value;

use super::validation::{LABEL_VALUE, QUALIFIED_NAME, is_label_value, is_qualified_name};

/// A parsed label selector; the empty one selects everything.
#[derive(Clone, Debug, Default)]
pub(crate) struct Selector(Vec<Requirement>);

#[derive(Clone, Debug)]
struct Requirement {
    key: String,
    operator: Operator,
    values: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Operator {
    /// `key=value`, `key==value`, `key in (a,b)`.
    In,
    /// `key!=value`, `key notin (a,b)`: also objects without the key.
    NotIn,
    /// `key`.
    Exists,
    /// `!key`.
    DoesNotExist,
}

impl Selector {
    /// Parses `text`. The error is the message of the 400 the server answers for a selector it
    /// cannot parse.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err("found ',', expected: identifier".to_owned());
            }
            requirements.push(Requirement::parse(part)?);
        }
        Ok(Self(requirements))
    }

    /// Whether an object with these `metadata.labels` (an object, or null for none) is
    /// selected.
    pub(crate) fn matches(&self, labels: &Value) -> bool {
        self.0.iter().all(|requirement| {
            let value = labels.get(&requirement.key).and_then(Value::as_str);
            match requirement.operator {
                Operator::Exists => value.is_some(),
                Operator::DoesNotExist => value.is_none(),
                Operator::In => value.is_some_and(|v| requirement.values.iter().any(|w| w == v)),
                Operator::NotIn => value.is_none_or(|v| requirement.values.iter().all(|w| w != v)),
            }
        })
    }
}

impl Requirement {
    fn parse(part: &str) -> Result<Self, String> {
        let unable = |why: String| format!("unable to parse requirement: {why}");
        if let Some(key) = part.strip_prefix('!') {
            return Self::new(key.trim(), Operator::DoesNotExist, Vec::new()).map_err(unable);
        }
        for (symbol, operator) in [
            ("!=", Operator::NotIn),
            ("==", Operator::In),
            ("=", Operator::In),
        ] {
            if let Some((key, value)) = part.split_once(symbol) {
                return Self::new(key.trim(), operator, vec![value.trim().to_owned()])
                    .map_err(unable);
            }
        }
        let mut words = part.splitn(2, char::is_whitespace);
        let key = words.next().unwrap_or_default();
        let rest = words.next().unwrap_or_default().trim();
        if rest.is_empty() {
            return Self::new(key, Operator::Exists, Vec::new()).map_err(unable);
        }
        let (operator, list) = if let Some(list) = rest.strip_prefix("notin") {
            (Operator::NotIn, list)
        } else if let Some(list) = rest.strip_prefix("in") {
            (Operator::In, list)
        } else {
            return Err(unable(format!(
                "found '{rest}', expected: in, notin, =, ==, !=, gt, lt"
            )));
        };
        let values = list
            .trim()
            .strip_prefix('(')
            .and_then(|l| l.strip_suffix(')'))
            .ok_or_else(|| unable(format!("found '{}', expected: '('", list.trim())))?;
        let values = values.split(',').map(|v| v.trim().to_owned()).collect();
        Self::new(key, operator, values).map_err(unable)
    }

    /// `NewRequirement`: a qualified-name key and label values.
    fn new(key: &str, operator: Operator, values: Vec<String>) -> Result<Self, String> {
        if !is_qualified_name(key) {
            return Err(format!("invalid label key \"{key}\": {QUALIFIED_NAME}"));
        }
        if let Some(bad) = values.iter().find(|v| !is_label_value(v)) {
            return Err(format!("invalid label value: \"{bad}\": {LABEL_VALUE}"));
        }
        Ok(Self {
            key: key.to_owned(),
            operator,
            values,
        })
    }
}

/// Splits at the commas outside parentheses.
fn split_top_level(text: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0_usize, 0);
    for (at, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn selectors_select_as_kube_apiserver_does() {
        let labels = json!({"app": "web", "leader-rs.io/leader": "billing", "tier": "front"});
        for (selector, selected) in [
            ("", true),
            ("app=web", true),
            ("app==web", true),
            ("app=db", false),
            ("app!=db", true),
            ("missing!=x", true),
            ("leader-rs.io/leader=billing,app=web", true),
            ("leader-rs.io/leader=billing,app=db", false),
            ("tier in (front, back)", true),
            ("tier notin (front)", false),
            ("missing notin (front)", true),
            ("app", true),
            ("!app", false),
            ("!missing", true),
            (" app = web , tier ", true),
        ] {
            let parsed = Selector::parse(selector).expect(selector);
            assert_eq!(parsed.matches(&labels), selected, "{selector}");
        }
        assert!(!Selector::parse("app").unwrap().matches(&Value::Null));
        assert!(Selector::parse("!app").unwrap().matches(&Value::Null));
        for bad in [
            "app=web,",
            "Bad Key=1",
            "app=not valid",
            "tier in front",
            "tier gt",
        ] {
            let err = Selector::parse(bad).expect_err(bad);
            assert!(
                err.starts_with("unable to parse requirement") || err.contains("found ','"),
                "{bad}: {err}"
            );
        }
    }
}
