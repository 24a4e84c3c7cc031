//! The lock-URL table of the READMEs is rendered from `leader::BACKENDS`, so that a backend, a
//! scheme or an example changes in one place. Every README that shows the table holds exactly
//! this rendering between `<!-- lock-urls -->` and `<!-- /lock-urls -->`. Every published
//! crate's README renders on crates.io: no rustdoc hidden lines in its Rust examples (crates.io
//! prints them as written) and no relative links (they lead nowhere there). No server is needed.

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

/// The README of every crate the workspace publishes (none with `publish = false`), from the
/// repository's root: in the repository all of them; in the crate's package, its own.
fn published_readmes() -> Vec<(String, PathBuf)> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest_dir.join("../..");
    if !root.join("crates/leader/Cargo.toml").is_file() {
        return vec![("README.md".to_owned(), manifest_dir.join("README.md"))];
    }
    let crates = std::fs::read_dir(root.join("crates")).expect("the crates directory");
    let mut readmes: Vec<(String, PathBuf)> = crates
        .map(|entry| entry.expect("a crate's directory").path())
        .filter(|dir| {
            let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap_or_default();
            let unpublished = manifest
                .lines()
                .any(|line| line.trim() == "publish = false");
            dir.join("README.md").is_file() && !unpublished
        })
        .map(|dir| {
            let name = dir.file_name().expect("a name").to_string_lossy();
            (format!("crates/{name}/README.md"), dir.join("README.md"))
        })
        .collect();
    readmes.sort();
    readmes
}

/// Whether rustdoc runs a fenced block with this info string as Rust: no language, `rust`, or
/// only rustdoc's attributes (`no_run`, `ignore`, `edition2024`, ...).
fn is_rust(info: &str) -> bool {
    const ATTRIBUTES: &[&str] = &[
        "no_run",
        "ignore",
        "should_panic",
        "compile_fail",
        "test_harness",
    ];
    info.split([',', ' ', '\t'])
        .filter(|token| !token.is_empty())
        .all(|token| {
            token == "rust"
                || ATTRIBUTES.contains(&token)
                || token.starts_with("edition")
                || token.starts_with("ignore-")
        })
}

/// `text` with every fenced code block and code span blanked out (same length, same lines), so
/// that only prose is left to look for links in; and the Rust blocks' lines that rustdoc hides
/// (`# ...` or a lone `#`), as `(line number, line)`.
fn prose_and_hidden_lines(text: &str) -> (String, Vec<(usize, String)>) {
    let blank = |s: &str| {
        s.chars()
            .map(|c| if c == '\n' { c } else { ' ' })
            .collect::<String>()
    };
    let mut prose = String::with_capacity(text.len());
    let mut hidden = Vec::new();
    let mut fence: Option<bool> = None; // inside a block: whether it is Rust
    for (n, line) in text.split_inclusive('\n').enumerate() {
        let trimmed = line.trim();
        if let Some(info) = trimmed.strip_prefix("```") {
            fence = match fence {
                None => Some(is_rust(info)),
                Some(_) => None,
            };
            prose.push_str(&blank(line));
            continue;
        }
        match fence {
            Some(rust) => {
                if rust && (trimmed == "#" || line.trim_start().starts_with("# ")) {
                    hidden.push((n + 1, line.trim_end().to_owned()));
                }
                prose.push_str(&blank(line));
            }
            None => prose.push_str(line),
        }
    }
    // Code spans: a run of backticks up to the next run of exactly as many.
    let mut masked = String::with_capacity(prose.len());
    let mut rest = prose.as_str();
    while let Some(start) = rest.find('`') {
        masked.push_str(&rest[..start]);
        let ticks = |s: &str| s.bytes().take_while(|&b| b == b'`').count();
        let run = ticks(&rest[start..]);
        let after = &rest[start + run..];
        let mut at = 0;
        let close = loop {
            let Some(i) = after[at..].find('`') else {
                break None;
            };
            let len = ticks(&after[at + i..]);
            if len == run {
                break Some(at + i);
            }
            at += i + len;
        };
        match close {
            Some(close) => {
                masked.push_str(&blank(&rest[start..start + run + close + run]));
                rest = &after[close + run..];
            }
            // No closing run: the backticks are text.
            None => {
                masked.push_str(&rest[start..start + run]);
                rest = after;
            }
        }
    }
    masked.push_str(rest);
    (masked, hidden)
}

/// Links in the prose whose target is neither a web address nor an anchor of the page, as
/// `(line number, target)`: inline links (`[text](target)`) and reference definitions
/// (`[label]: target`).
fn relative_links(prose: &str) -> Vec<(usize, String)> {
    let line_of = |at: usize| prose[..at].matches('\n').count() + 1;
    let absolute = |target: &str| target.starts_with("http") || target.starts_with('#');
    let mut found = Vec::new();
    for (at, _) in prose.match_indices("](") {
        let target = prose[at + 2..].trim_start();
        let target = target.trim_start_matches('<');
        let end = target.find([')', ' ', '\n', '>']).unwrap_or(target.len());
        if !absolute(&target[..end]) {
            found.push((line_of(at), target[..end].to_owned()));
        }
    }
    let mut offset = 0;
    for line in prose.split_inclusive('\n') {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some(close) = trimmed.find("]: ")
        {
            let definition = trimmed[close + 3..].trim();
            let (target, title) = definition.split_once(' ').unwrap_or((definition, ""));
            // Prose such as "[`Lock`]: what it does" is no definition: a title is quoted.
            let defines = title.is_empty() || title.starts_with(['"', '\'', '(']);
            if defines && !absolute(target.trim_start_matches('<')) {
                found.push((line_of(offset), target.to_owned()));
            }
        }
        offset += line.len();
    }
    found.sort();
    found
}

/// What would not render on crates.io in a README's `text`, one line each.
fn registry_problems(text: &str) -> Vec<String> {
    let (prose, hidden) = prose_and_hidden_lines(text);
    let hidden = hidden
        .into_iter()
        .map(|(n, line)| format!("{n}: a hidden line, printed on crates.io as written: {line}"));
    let links = relative_links(&prose).into_iter().map(|(n, target)| {
        format!(
            "{n}: a relative link, leading nowhere on crates.io: {target} \
             (https://github.com/leader-rs/leader/blob/main/PATH, or a docs.rs address)"
        )
    });
    hidden.chain(links).collect()
}

#[test]
fn every_published_readme_renders_on_the_registry() {
    let readmes = published_readmes();
    assert!(!readmes.is_empty(), "no README found to check");
    let mut problems = Vec::new();
    for (name, path) in readmes {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{name}: {err}"));
        problems.extend(
            registry_problems(&text)
                .into_iter()
                .map(|p| format!("{name}:{p}")),
        );
    }
    assert!(
        problems.is_empty(),
        "READMEs that crates.io would show broken (examples are whole visible programs; links \
         are absolute):\n{}",
        problems.join("\n")
    );
}

#[test]
fn hidden_lines_and_relative_links_are_found() {
    let fine = "intro [docs](https://docs.rs/leader) and [below](#usage)\n\n\
        ```rust,no_run\n#[tokio::main]\nasync fn main() {}\n```\n\n\
        ```toml\n# a comment\nleader = \"0.1\"\n```\n\n\
        ```sh\n# a comment\n```\n\n\
        `[not](a-link)` and ``a `](x)` span``\n\n\
        [`LeaseLock`]: what it does, [its docs]: https://docs.rs/leader-kube\n\n\
        ```text\n[not](a-link)\n```\n";
    assert_eq!(registry_problems(fine), Vec::<String>::new());
    for (broken, line) in [
        ("```rust\n# fn main() {}\n```\n", 2),
        ("```\n#\nfn main() {}\n```\n", 2),
        ("```rust,no_run\n    # async fn f() {}\n```\n", 2),
        (
            "see\n[the example](crates/leader/examples/kubernetes.rs)\n",
            2,
        ),
        ("[`run`](LeaderElector::run)\n", 1),
        ("a `span` then [a link]( deploy/kubernetes)\n", 1),
        ("text\n\n[label]: ../BENCHMARKS.md\n", 3),
        ("[`Lock`]: <deploy/rbac.yaml> \"RBAC\"\n", 1),
    ] {
        let problems = registry_problems(broken);
        assert_eq!(problems.len(), 1, "{broken:?}: {problems:?}");
        assert!(
            problems[0].starts_with(&format!("{line}: ")),
            "{problems:?}"
        );
    }
}
