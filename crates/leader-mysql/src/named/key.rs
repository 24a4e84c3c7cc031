//! The user-level lock's name, within MySQL's 64 characters.

use super::MAX_KEY;

/// The user-level lock's name: `leader:database.table/name` when that is at most 64
/// characters of ASCII without capitals (the server compares lock names without regard to
/// case), otherwise `leader#` and a hash of the three, with a readable part of the name.
pub(super) fn lock_key(database: &str, table: &str, name: &str) -> String {
    let plain = format!("leader:{database}.{table}/{name}");
    let fits = plain.len() <= MAX_KEY
        && plain
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b.is_ascii_uppercase());
    if fits {
        return plain;
    }
    let hash = leader_core::backend::fnv1a(&[database, table, name]);
    let readable: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' | '_' | '.' | '/' => c,
            _ => '_',
        })
        .take(MAX_KEY - "leader#0123456789abcdef:".len())
        .collect();
    format!("leader#{hash:016x}:{readable}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_fit_and_keep_names_apart() {
        assert_eq!(
            lock_key("app", "leader_election", "billing"),
            "leader:app.leader_election/billing"
        );
        let long = "x".repeat(100);
        for (database, table, name) in [
            ("app", "leader_election", long.as_str()),
            ("app", "leader_election", "Billing"),
            ("app", "leader_election", "naïve"),
            ("app", "leader_election", "a b"),
        ] {
            let key = lock_key(database, table, name);
            assert!(key.len() <= MAX_KEY, "{key}");
            assert!(key.starts_with("leader#"), "{key}");
        }
        // Names that differ only in case are different records: different locks.
        assert_ne!(
            lock_key("app", "t", "Billing").to_ascii_lowercase(),
            lock_key("app", "t", "billing").to_ascii_lowercase()
        );
        assert_ne!(
            lock_key("app", "t", &format!("{long}1")),
            lock_key("app", "t", &format!("{long}2"))
        );
        assert_ne!(lock_key("a", "t", "n"), lock_key("b", "t", "n"));
    }
}
