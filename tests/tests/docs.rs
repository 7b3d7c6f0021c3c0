//! The documentation holds together: every relative link in `README.md`,
//! `docs/*.md` and `python/README.md` names a file that exists, every
//! `#anchor` names a heading of its page by GitHub's slug, the README links
//! every page of `docs/`, `docs/how-it-works.md` links every design
//! document of `docs/internals/`, and the README stays a front page.
//!
//! Standard library only: a small Markdown reader that knows fenced code
//! blocks, inline code spans, `[text](target)` links and ATX headings, which
//! is all these pages use.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

/// Past this the README is a manual again: move the section to `docs/`.
const README_MAX_LINES: usize = 320;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies in the repo")
        .to_path_buf()
}

/// The pages whose links are checked: the README, every `docs/*.md`, and
/// the Python package's README.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages = vec![root.join("README.md"), root.join("python/README.md")];
    pages.extend(markdown_in(&root.join("docs")));
    pages.extend(markdown_in(&root.join("docs/internals")));
    pages
}

/// The `.md` files of one folder, sorted.
fn markdown_in(dir: &Path) -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("the folder is readable").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    docs
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// `path` relative to the repository root, for messages.
fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

// ------------------------------------------------------------------ reading

/// Opens or closes a fenced code block: three or more backticks or tildes.
fn fence(line: &str) -> Option<(char, usize)> {
    let line = line.trim_start();
    let c = line.chars().next().filter(|c| *c == '`' || *c == '~')?;
    let run = line.chars().take_while(|x| *x == c).count();
    (run >= 3).then_some((c, run))
}

/// The lines outside fenced code blocks; a fence's own lines and the lines
/// inside it come back empty, so paragraphs and line numbers stay apart.
fn outside_fences(text: &str) -> Vec<&str> {
    let mut open: Option<(char, usize)> = None;
    text.lines()
        .map(|line| match (open, fence(line)) {
            (None, Some(f)) => {
                open = Some(f);
                ""
            }
            (Some((c, n)), Some((d, m)))
                if c == d && m >= n && line.trim().chars().all(|x| x == c) =>
            {
                open = None;
                ""
            }
            (Some(_), _) => "",
            (None, None) => line,
        })
        .collect()
}

/// The text of each ATX heading (`## Title ##` → `Title`) outside fences.
fn headings(text: &str) -> Vec<String> {
    outside_fences(text)
        .into_iter()
        .filter_map(|line| {
            let indent = line.len() - line.trim_start_matches(' ').len();
            let rest = line[indent..].trim_start_matches('#');
            let level = line.len() - indent - rest.len();
            if indent > 3 || !(1..=6).contains(&level) {
                return None;
            }
            if !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
                return None;
            }
            // An optional closing run of `#`, set off by a space.
            let rest = rest.trim();
            let closed = rest.trim_end_matches('#');
            let rest = if closed.is_empty() || closed.ends_with([' ', '\t']) {
                closed.trim_end()
            } else {
                rest
            };
            Some(rest.to_string())
        })
        .collect()
}

/// Replaces each inline code span (a backtick run up to the next run of
/// the same length) with `C` and the line breaks it held, so that nothing
/// inside one reads as a link and lines still count.
fn without_code_spans(paragraph: &str) -> String {
    let chars: Vec<char> = paragraph.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|c| **c == '`').count();
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let other = chars[j..].iter().take_while(|c| **c == '`').count();
                if other == run {
                    close = Some(j);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                out.push('C');
                out.extend(chars[i..j].iter().filter(|c| **c == '\n'));
                i = j + run;
            }
            None => {
                // An unmatched run is literal backticks.
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// Every `[text](target)` (and `![alt](target)`) outside fences and code
/// spans, with the 1-based line it starts on. Link text may run over lines;
/// paragraphs (blank-line separated) bound it.
fn links(text: &str) -> Vec<(usize, String)> {
    let lines = outside_fences(text);
    let mut found = Vec::new();
    let mut start = 0;
    while start < lines.len() {
        if lines[start].trim().is_empty() {
            start += 1;
            continue;
        }
        let end = (start..lines.len())
            .find(|i| lines[*i].trim().is_empty())
            .unwrap_or(lines.len());
        // Code spans go per paragraph: they may cross lines, not paragraphs.
        let paragraph = without_code_spans(&lines[start..end].join("\n"));
        for (offset, target) in links_in(&paragraph) {
            let line = start + 1 + paragraph[..offset].matches('\n').count();
            found.push((line, target));
        }
        start = end;
    }
    found
}

/// `(byte offset of the '[', target)` for each inline link in one paragraph.
fn links_in(paragraph: &str) -> Vec<(usize, String)> {
    let bytes = paragraph.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'[' {
            i += 1;
            continue;
        }
        // The matching `]`, allowing nested brackets in the text.
        let mut depth = 0;
        let mut close = None;
        for (j, b) in bytes.iter().enumerate().skip(i) {
            match b {
                b'[' => depth += 1,
                b']' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(j);
                        break;
                    }
                }
                _ => {}
            }
        }
        // `[text]` alone (or an unmatched `[`) is no link: read on after it.
        let inline = close
            .filter(|close| bytes.get(close + 1) == Some(&b'('))
            .and_then(|close| Some((close, paragraph[close + 2..].find(')')?)));
        let Some((close, len)) = inline else {
            i += 1;
            continue;
        };
        let inside = paragraph[close + 2..close + 2 + len].trim();
        // `(target "title")`: the target is the first word.
        let target = inside.split_whitespace().next().unwrap_or("");
        let target = target.trim_start_matches('<').trim_end_matches('>');
        found.push((i, target.to_string()));
        i = close + 2 + len + 1;
    }
    found
}

// ------------------------------------------------------------------ slugs

/// A heading's text as GitHub renders it: links become their text, code
/// spans their content, emphasis markers go.
fn rendered(heading: &str) -> String {
    // `[text](url)` → `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        let link = after.find("](").and_then(|mid| {
            after[mid + 2..]
                .find(')')
                .map(|end| (mid, mid + 2 + end + 1))
        });
        match link {
            Some((mid, end)) => {
                text.push_str(&rest[..open]);
                text.push_str(&after[..mid]);
                rest = &after[end..];
            }
            None => {
                text.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    text.push_str(rest);
    // Outside code spans, `*` and word-edge `_` are emphasis; inside, text.
    text.split('`')
        .enumerate()
        .map(|(n, part)| {
            if n % 2 == 1 {
                return part.to_string();
            }
            part.replace('*', "")
                .split(' ')
                .map(|word| word.trim_matches('_'))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// GitHub's anchor for a heading, before de-duplication (github-slugger):
/// lower-case; letters, digits, `-` and `_` stay; each space becomes `-`;
/// everything else goes.
fn slug(heading: &str) -> String {
    rendered(heading)
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor a page has: a repeated slug gets `-1`, `-2`, ... as on
/// GitHub.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut occurrences: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for heading in headings(text) {
        let base = slug(&heading);
        let mut anchor = base.clone();
        while occurrences.contains_key(&anchor) {
            let n = occurrences.get_mut(&base).expect("the base slug was seen");
            *n += 1;
            anchor = format!("{base}-{n}");
        }
        occurrences.insert(anchor.clone(), 0);
        out.insert(anchor);
    }
    out
}

// ------------------------------------------------------------------ checking

/// What is wrong with one link from `page`, if anything.
fn check(root: &Path, page: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    if target.is_empty() {
        return Some("empty link target".into());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((path, anchor)) => (path, Some(anchor)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        page.to_path_buf()
    } else if let Some(from_root) = path.strip_prefix('/') {
        root.join(from_root)
    } else {
        page.parent().expect("a page lies in a folder").join(path)
    };
    if !file.exists() {
        return Some(format!("no such file {}", shown(root, &file)));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|ext| ext != "md") {
        return None; // a line anchor into source, say: GitHub's to resolve
    }
    if anchor.is_empty() {
        return Some("empty `#` anchor".into());
    }
    if anchors(&read(&file)).contains(anchor) {
        None
    } else {
        Some(format!(
            "no heading in {} has the slug `{anchor}`",
            shown(root, &file)
        ))
    }
}

#[test]
fn every_link_in_the_documentation_resolves() {
    let root = repo_root();
    let mut broken = Vec::new();
    let mut relative = 0;
    for page in pages(&root) {
        for (line, target) in links(&read(&page)) {
            if !target.contains("://") && !target.starts_with("mailto:") {
                relative += 1;
            }
            if let Some(why) = check(&root, &page, &target) {
                broken.push(format!(
                    "  {}:{line}: ({target}): {why}",
                    shown(&root, &page)
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "{} broken link(s) in the documentation:\n{}",
        broken.len(),
        broken.join("\n")
    );
    // A reader that found no links would pass the check above vacuously.
    assert!(
        relative >= 20,
        "only {relative} relative links found in the documentation: is the link reader broken?"
    );
}

#[test]
fn the_readme_stays_a_front_page() {
    let readme = read(&repo_root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: it is the front page; \
         move the reference material to a page in docs/ and link it"
    );
}

#[test]
fn the_readme_links_every_docs_page() {
    let root = repo_root();
    let readme = root.join("README.md");
    let linked: BTreeSet<PathBuf> = links(&read(&readme))
        .into_iter()
        .filter(|(_, target)| !target.contains("://"))
        .map(|(_, target)| root.join(target.split('#').next().unwrap_or_default()))
        .collect();
    let unlinked: Vec<String> = pages(&root)
        .into_iter()
        .filter(|page| page.parent() == Some(root.join("docs").as_path()))
        .filter(|page| !linked.contains(page))
        .map(|page| shown(&root, &page))
        .collect();
    assert!(
        unlinked.is_empty(),
        "README.md's Documentation section does not link: {}",
        unlinked.join(", ")
    );
}

/// The design documents are reached from the developers' page: every
/// `docs/internals/` page is linked from `docs/how-it-works.md`.
#[test]
fn how_it_works_links_every_internals_page() {
    let root = repo_root();
    let page = root.join("docs/how-it-works.md");
    let linked: BTreeSet<PathBuf> = links(&read(&page))
        .into_iter()
        .filter(|(_, target)| !target.contains("://"))
        .map(|(_, target)| {
            root.join("docs")
                .join(target.split('#').next().unwrap_or_default())
        })
        .collect();
    let unlinked: Vec<String> = markdown_in(&root.join("docs/internals"))
        .into_iter()
        .filter(|page| !linked.contains(page))
        .map(|page| shown(&root, &page))
        .collect();
    assert!(
        unlinked.is_empty(),
        "docs/how-it-works.md does not link: {}",
        unlinked.join(", ")
    );
}

#[test]
fn slugs_are_githubs() {
    for (heading, expected) in [
        ("Config (TOML)", "config-toml"),
        (
            "`berth run`: one model, one shot",
            "berth-run-one-model-one-shot",
        ),
        ("Workers' privileges", "workers-privileges"),
        ("Worker kinds: `[workers.NAME]`", "worker-kinds-workersname"),
        ("1. Transport", "1-transport"),
        ("Worker → supervisor", "worker--supervisor"),
        (
            "**Bold**, _emphasis_ and `max_rss`",
            "bold-emphasis-and-max_rss",
        ),
        ("A [linked](other.md#x) word", "a-linked-word"),
        (
            "Load time and memory by load mode (median of 3 loads, max memory)",
            "load-time-and-memory-by-load-mode-median-of-3-loads-max-memory",
        ),
    ] {
        assert_eq!(slug(heading), expected, "the slug of `{heading}`");
    }
    let page = "# Title #\n\n## Example\n\n```sh\n# not a heading\n```\n\n\
                ### Example\n\n#### Example\n\n#no-space is not a heading\n";
    let expected: BTreeSet<String> = ["title", "example", "example-1", "example-2"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(anchors(page), expected);
}

#[test]
fn links_are_read_outside_code_only() {
    let page = "See [a page](a.md) and [the\nsection](b.md#sec \"title\").\n\n\
                `[not](a-link.md)` but [`code` text](c.md).\n\n\
                ```md\n[inside](fence.md)\n```\n\n\
                [no target] and ![image](d.png) and [x]: e.md\n\n\
                A `code span\nover lines` and [ unmatched, then [f](f.md).\n";
    let found = links(page);
    assert_eq!(
        found,
        vec![
            (1, "a.md".to_string()),
            (1, "b.md#sec".to_string()),
            (4, "c.md".to_string()),
            (10, "d.png".to_string()),
            (13, "f.md".to_string()),
        ]
    );
}

/// The text of `page` from heading `start` to the next heading of its level.
fn section<'a>(page: &'a str, start: &str) -> &'a str {
    let at = page
        .find(&format!("\n{start}\n"))
        .unwrap_or_else(|| panic!("no `{start}` heading"));
    let body = &page[at + start.len() + 2..];
    let level = start.split(' ').next().unwrap_or("##");
    let end = body.find(&format!("\n{level} ")).unwrap_or(body.len());
    &body[..end]
}

/// The figures a text quotes: a number, or a range of two, with its unit
/// (`0.97–1.06×`, `~80 ms`, `1.2 GiB`, `0.30–0.32%`).
fn figures(text: &str) -> BTreeSet<String> {
    const UNITS: &[&str] = &["×", "%", " µs", " ms", " s", " MiB", " GiB", " MB", " GB"];
    let chars: Vec<char> = text.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit()
            || (chars[i] == '~' && chars.get(i + 1).is_some_and(char::is_ascii_digit));
        let glued = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '.');
        if !starts || glued {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < chars.len() && (chars[j].is_ascii_digit() || ".–~".contains(chars[j])) {
            j += 1;
        }
        let rest: String = chars[j..(j + 6).min(chars.len())].iter().collect();
        // A unit ends the word (` s` is seconds, ` stays` is not).
        let whole = |u: &str| {
            rest.starts_with(u) && !rest[u.len()..].starts_with(|c: char| c.is_alphanumeric())
        };
        if let Some(unit) = UNITS.iter().find(|u| whole(u)) {
            let number: String = chars[i..j].iter().collect();
            out.insert(format!(
                "{}{}",
                number.trim_end_matches('.'),
                unit.trim_end()
            ));
        }
        i = j;
    }
    out
}

#[test]
fn figures_are_read_with_their_units() {
    let found = figures(
        "at **0.97–1.06×** and ~80 ms, 1.25 s cold, 0.30–0.32% of a core, 1.2 GiB; a 2-vCPU VM, H100, 75 MiB.",
    );
    let expected: BTreeSet<String> = [
        "0.97–1.06×",
        "~80 ms",
        "1.25 s",
        "0.30–0.32%",
        "1.2 GiB",
        "75 MiB",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(found, expected);
}

/// The README's performance brief quotes only what the summary table of
/// `docs/performance.md` holds: a reader who stops at the front page or at
/// the first table leaves with the current figure.
#[test]
fn every_figure_in_the_readme_brief_is_in_the_performance_summary() {
    let root = repo_root();
    let readme = read(&root.join("README.md"));
    let brief = section(&readme, "## Performance, in brief");
    let performance = read(&root.join("docs/performance.md"));
    let summary = section(&performance, "## Summary");
    let quoted = figures(brief);
    assert!(
        quoted.len() >= 15,
        "the brief's figures were not found: {quoted:?}"
    );
    let held = figures(summary);
    let missing: Vec<&String> = quoted.iter().filter(|f| !held.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "README.md's performance brief quotes {missing:?}, which docs/performance.md's summary \
         table does not hold: put the current figure in the table, and quote that"
    );
}
