//! The lock-URL table of the READMEs is rendered from `leader::BACKENDS`, so that a backend, a
//! scheme or an example changes in one place. Every README that shows the table holds exactly
//! this rendering between `<!-- lock-urls -->` and `<!-- /lock-urls -->`. No server is needed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use leader::{BACKENDS, LockUrl, LockUrlError};

const BEGIN: &str = "<!-- lock-urls -->";
const END: &str = "<!-- /lock-urls -->";

/// The READMEs that show the table, from the repository's root.
const READMES: &[&str] = &[
    "README.md",
    "crates/leader/README.md",
    "crates/leader-core/README.md",
    "crates/leader-cli/README.md",
];

/// The table as the READMEs show it, one row per backend in the order of `BACKENDS`.
fn lock_url_table() -> String {
    let mut table =
        String::from("| scheme | lock | feature | crate | example |\n|---|---|---|---|---|\n");
    for backend in BACKENDS {
        let schemes = backend
            .schemes
            .iter()
            .map(|scheme| format!("`{scheme}://`"))
            .collect::<Vec<_>>()
            .join(", ");
        let feature = if backend.feature.is_empty() {
            "(always)".to_owned()
        } else {
            format!("`{}`", backend.feature)
        };
        let krate = format!("[`{0}`](https://docs.rs/{0})", backend.crate_name);
        let row = [
            schemes.as_str(),
            backend.description,
            &feature,
            &krate,
            &format!("`{}`", backend.example),
        ];
        for cell in row {
            // A `|` or a line break would end the cell, or the row, in Markdown.
            assert!(!cell.contains(['|', '\n']), "{}: {cell:?}", backend.name);
        }
        writeln!(table, "| {} |", row.join(" | ")).expect("write to a String");
    }
    table
}

/// The block a README holds: the markers around the table.
fn expected_block() -> String {
    format!("{BEGIN}\n{}{END}", lock_url_table())
}

/// The READMEs to check, each with its name for messages: in the repository all of them; in
/// the crate's package, its own.
fn readmes() -> Vec<(String, PathBuf)> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest_dir.join("../..");
    if root.join("crates/leader/Cargo.toml").is_file() {
        READMES
            .iter()
            .map(|readme| ((*readme).to_owned(), root.join(readme)))
            .collect()
    } else {
        vec![("README.md".to_owned(), manifest_dir.join("README.md"))]
    }
}

/// What is wrong with the table block of `text`, if anything.
fn check(text: &str) -> Result<(), String> {
    let expected = expected_block();
    match text.matches(BEGIN).count() {
        1 => {}
        0 => return Err(format!("no {BEGIN} marker")),
        n => return Err(format!("{n} {BEGIN} markers, where one is expected")),
    }
    let start = text.find(BEGIN).expect("counted above");
    let Some(len) = text[start..].find(END) else {
        return Err(format!("no {END} after {BEGIN}"));
    };
    let found = &text[start..start + len + END.len()];
    let mut found_lines = found.lines();
    for (n, line) in expected.lines().enumerate() {
        match found_lines.next() {
            Some(was) if was == line => {}
            Some(was) => {
                return Err(format!(
                    "line {} of the table differs:\n  found:    {was}\n  expected: {line}",
                    n + 1
                ));
            }
            None => return Err(format!("the table ends before line {}", n + 1)),
        }
    }
    match found_lines.next() {
        None => Ok(()),
        Some(extra) => Err(format!("a line more than BACKENDS has: {extra}")),
    }
}

#[test]
fn every_readme_shows_the_lock_url_table_rendered_from_backends() {
    let mut drifted = Vec::new();
    for (name, path) in readmes() {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{name}: {err}"));
        if let Err(problem) = check(&text) {
            drifted.push(format!("{name}: {problem}"));
        }
    }
    assert!(
        drifted.is_empty(),
        "{}\n\nEach of these READMEs should hold, in place of its table:\n\n{}\n",
        drifted.join("\n\n"),
        expected_block()
    );
}

#[test]
fn a_drifted_table_is_found() {
    let table = expected_block();
    assert_eq!(check(&format!("intro\n\n{table}\n\nmore\n")), Ok(()));
    let changed = table.replacen("| `file://`", "| `dir://`", 1);
    assert!(check(&changed).is_err());
    assert!(check("no table here").is_err());
    assert!(check(&format!("{table}\n{table}")).is_err());
    assert!(check(&format!("{BEGIN}\n| a |\n")).is_err());
}

/// Every example URL is one of its backend's schemes, and parses wherever its backend is built
/// (all of them with `--all-features`); a backend left out names its own feature.
#[test]
fn every_example_url_parses_with_its_backend() {
    for backend in BACKENDS {
        let example = backend.example;
        let scheme = example.split_once("://").expect("a URL").0;
        assert!(backend.schemes.contains(&scheme), "{example}");
        match LockUrl::parse(example) {
            Ok(_) => {}
            Err(LockUrlError::NotBuilt { feature, .. }) => {
                assert_eq!(feature, backend.feature, "{example}");
            }
            Err(err) => panic!("{example}: {err}"),
        }
    }
}
