//! A `file://` URL's directory holds one election per name, each in a directory of its own, as
//! every other store keeps one record per name. The directory of an earlier release held one
//! election whatever the name; such a directory is still used as it is, and a directory of the
//! per-name layout carries a marker in the place of that layout's first version, which an
//! earlier release reads as a record it cannot decode: it never leads there, and never writes
//! there (S8), so a rollout from it to this release never gives two leaders.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::dir::{ensure_private_dir, io_error, newest_versions, read_listed, version_name};
use crate::error::LockError;

/// What the marker file holds.
const MARKER: &str = r#"{"layout":"a directory per election: the elections are in the directories beside this file"}"#;

/// The directory of election `name` under a `file://` URL's directory `dir`: `dir/NAME` (the
/// name percent-encoded), or `dir` itself when it holds an election of the earlier layout. The
/// directory is made (private, as a lock directory is) and marked when it holds nothing yet.
///
/// # Errors
/// The directory cannot be read, made or marked, or is not this user's own.
pub(crate) fn election_dir(dir: &Path, name: &str) -> Result<PathBuf, LockError> {
    if holds_one_election(dir)? {
        tracing::warn!(
            dir = %dir.display(),
            election = name,
            "this file lock directory holds one election for every name (the layout of earlier \
             releases): every election named on it shares that lock; once no replica of an \
             earlier release runs, stop the replicas, remove the directory, and start them \
             again for one election per name"
        );
        return Ok(dir.to_owned());
    }
    ensure_private_dir(dir)?;
    mark(dir)?;
    Ok(dir.join(encode(name)))
}

/// Whether `dir` holds the versions of one election (the earlier layout): a newest version
/// that is not the marker, readable or not.
fn holds_one_election(dir: &Path) -> Result<bool, LockError> {
    if newest_versions(dir)?.is_empty() {
        return Ok(false);
    }
    match read_listed(dir) {
        (Some(newest), Err(_)) => {
            let path = dir.join(version_name(newest));
            let bytes = fs::read(&path).map_err(|err| io_error(&path, err))?;
            Ok(bytes != MARKER.as_bytes())
        }
        _ => Ok(true),
    }
}

/// Writes the marker in the place of the earlier layout's first version, unless a version is
/// there already (another process's marker, written first).
fn mark(dir: &Path) -> Result<(), LockError> {
    if !newest_versions(dir)?.is_empty() {
        return Ok(());
    }
    let target = dir.join(version_name(1));
    let tmp = dir.join(format!(".tmp-{:016x}", fastrand::u64(..)));
    let written = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(MARKER.as_bytes())?;
        file.sync_all()?;
        match fs::hard_link(&tmp, &target) {
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            other => other,
        }
    })();
    let _ = fs::remove_file(&tmp);
    written.map_err(|err| io_error(&target, err))
}

/// `name` as one path segment: letters, digits, `-` and `_` as they are, every other byte
/// percent-encoded (`app.v1` is `app%2Ev1`), so that no name is a path of several segments, a
/// version file's name, `.` or `..`, and no two names share a directory.
fn encode(name: &str) -> String {
    let mut encoded = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    if encoded.is_empty() {
        // An empty name is a name too, and no directory may be called "".
        encoded.push('%');
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_one_segment_each_and_distinct() {
        let names = [
            "jobs",
            "app.v1",
            "app%2Ev1",
            "a/b",
            "..",
            ".",
            "",
            "v00000000000000000001.json",
        ];
        let encoded: Vec<String> = names.iter().map(|n| encode(n)).collect();
        for (name, segment) in names.iter().zip(&encoded) {
            assert!(
                !segment.contains('/') && !segment.is_empty(),
                "{name}: {segment}"
            );
            assert!(!segment.starts_with('.'), "{name}: {segment}");
        }
        let distinct: std::collections::BTreeSet<&String> = encoded.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{encoded:?}");
        assert_eq!(encode("nightly-report"), "nightly-report");
    }

    #[test]
    fn a_directory_is_marked_once_and_its_elections_are_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("locks");
        let a = election_dir(&path, "a").expect("a");
        let b = election_dir(&path, "b").expect("b");
        assert_ne!(a, b);
        assert_eq!(a, path.join("a"));
        assert!(!holds_one_election(&path).expect("read"));
        assert_eq!(newest_versions(&path).expect("versions"), vec![1]);
        // What an earlier release reads there: no record, so it never leads nor writes.
        assert!(super::super::dir::read(&path).is_err());
    }
}
