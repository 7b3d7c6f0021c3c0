//! The house's layers hold: in the `berth` crate each file names only
//! files of its own layer or of the layers below it, in the order
//! `docs/internals/layers.md` writes down (the table there is what this
//! test reads), and no crate's files name each other in a circle.
//!
//! Standard library only: a small reader of Rust source that knows
//! comments, string and character literals, attributes (`#[cfg(test)]`
//! items are left out: a test may name anything), `mod` declarations, `use`
//! trees and `crate::`/`super::`/`self::` paths. A path is followed through
//! the `use` bindings of the module it names (`crate::Supervisor` is the
//! file that defines `Supervisor`, not `lib.rs`), so a re-export cannot
//! hide an upward arrow.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies in the repo")
        .to_path_buf()
}

// ------------------------------------------------------------------ lexing

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
}

/// The tokens of `src` that matter here: identifiers, `::` and single
/// punctuation; comments, literals and lifetimes are dropped.
fn tokens(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let ident_char = |c: u8| c == b'_' || c.is_ascii_alphanumeric();
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == b'"' {
            i = skip_string(b, i + 1);
        } else if (c == b'r' || c == b'b' || c == b'c') && raw_string_start(b, i).is_some() {
            let (hashes, at) = raw_string_start(b, i).unwrap();
            i = skip_raw(b, at, hashes);
        } else if (c == b'b' || c == b'c') && b.get(i + 1) == Some(&b'"') {
            i = skip_string(b, i + 2);
        } else if c == b'b' && b.get(i + 1) == Some(&b'\'') {
            i = skip_char(b, i + 1);
        } else if c == b'\'' {
            // A character literal, or a lifetime/label.
            if b.get(i + 1) == Some(&b'\\') || b.get(i + 2) == Some(&b'\'') {
                i = skip_char(b, i);
            } else if let Some(len) = std::str::from_utf8(&b[i + 1..])
                .ok()
                .and_then(|s| s.chars().next())
                .map(char::len_utf8)
                .filter(|len| b.get(i + 1 + len) == Some(&b'\''))
            {
                i += len + 2;
            } else {
                i += 1;
                while i < b.len() && ident_char(b[i]) {
                    i += 1;
                }
            }
        } else if ident_char(c) {
            let start = i;
            while i < b.len() && ident_char(b[i]) {
                i += 1;
            }
            let word = &src[start..i];
            // `r#ident`
            let word = word.strip_prefix("r#").unwrap_or(word);
            if !word.as_bytes()[0].is_ascii_digit() {
                out.push(Tok::Ident(word.to_string()));
            }
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            out.push(Tok::Sep);
            i += 2;
        } else if c.is_ascii_whitespace() || !c.is_ascii() {
            i += 1;
        } else {
            out.push(Tok::Punct(c as char));
            i += 1;
        }
    }
    out
}

fn skip_string(b: &[u8], mut i: usize) -> usize {
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

fn skip_char(b: &[u8], mut i: usize) -> usize {
    i += 1; // the opening quote
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'\'' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// `r"`, `r#"`, `br##"`…: the number of hashes and where the body starts.
fn raw_string_start(b: &[u8], i: usize) -> Option<(usize, usize)> {
    if i > 0 && (b[i - 1] == b'_' || b[i - 1].is_ascii_alphanumeric()) {
        return None;
    }
    let mut j = i;
    if b[j] == b'b' || b[j] == b'c' {
        j += 1;
    }
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while b.get(j) == Some(&b'#') {
        hashes += 1;
        j += 1;
    }
    (b.get(j) == Some(&b'"')).then_some((hashes, j + 1))
}

fn skip_raw(b: &[u8], mut i: usize, hashes: usize) -> usize {
    while i < b.len() {
        if b[i] == b'"' && (0..hashes).all(|k| b.get(i + 1 + k) == Some(&b'#')) {
            return i + 1 + hashes;
        }
        i += 1;
    }
    i
}

// ------------------------------------------------------------------ reading a file

/// A module path inside one crate: its segments after `crate`.
type ModPath = Vec<String>;

/// What one file says: the modules it declares, its `use` bindings, and
/// the paths it names (each with the module it is written in).
#[derive(Debug, Default)]
struct FileFacts {
    /// `mod x;` (not under `#[cfg(test)]`), by the module that declares it.
    declared: Vec<(ModPath, String)>,
    /// `use` bindings: (module, name bound) → the path, as written, and the
    /// module it is written in.
    bindings: Vec<(ModPath, String, Vec<String>)>,
    /// Every path named (use trees included), as written, with its module.
    named: Vec<(ModPath, Vec<String>)>,
}

/// Reads the file whose module is `module`.
fn read_facts(tokens: &[Tok], module: &ModPath) -> FileFacts {
    let mut facts = FileFacts::default();
    // Inline modules open: their path and the brace depth they close at.
    let mut stack: Vec<(ModPath, usize)> = vec![(module.clone(), 0)];
    let mut depth = 0usize;
    let mut i = 0;
    let mut skip_next_item = false;
    while i < tokens.len() {
        let here = stack.last().expect("the file's own module").0.clone();
        match &tokens[i] {
            Tok::Punct('#') => {
                // An attribute: `#[...]` or `#![...]`.
                let mut j = i + 1;
                if tokens.get(j) == Some(&Tok::Punct('!')) {
                    j += 1;
                }
                if tokens.get(j) == Some(&Tok::Punct('[')) {
                    let end = matching(tokens, j, '[', ']');
                    let inner = &tokens[j + 1..end];
                    if is_cfg_test(inner) {
                        skip_next_item = true;
                    }
                    i = end + 1;
                    continue;
                }
                i += 1;
            }
            _ if skip_next_item => {
                skip_next_item = false;
                i = skip_item(tokens, i);
            }
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if stack.len() > 1 && stack.last().is_some_and(|(_, d)| *d == depth) {
                    stack.pop();
                }
                i += 1;
            }
            Tok::Ident(word) if word == "mod" => {
                let (Some(Tok::Ident(name)), next) = (tokens.get(i + 1), tokens.get(i + 2)) else {
                    i += 1;
                    continue;
                };
                match next {
                    Some(Tok::Punct(';')) => {
                        facts.declared.push((here.clone(), name.clone()));
                        i += 3;
                    }
                    Some(Tok::Punct('{')) => {
                        let mut inner = here.clone();
                        inner.push(name.clone());
                        stack.push((inner, depth));
                        depth += 1;
                        i += 3;
                    }
                    _ => i += 1,
                }
            }
            Tok::Ident(word) if word == "use" && starts_statement(tokens, i) => {
                let end = tokens[i..]
                    .iter()
                    .position(|t| *t == Tok::Punct(';'))
                    .map_or(tokens.len(), |p| i + p);
                let mut leaves = Vec::new();
                use_tree(&tokens[i + 1..end], &mut Vec::new(), &mut leaves);
                for (path, bound) in leaves {
                    if let Some(bound) = bound {
                        facts.bindings.push((here.clone(), bound, path.clone()));
                    }
                    facts.named.push((here.clone(), path));
                }
                i = end + 1;
            }
            Tok::Ident(first) if tokens.get(i + 1) == Some(&Tok::Sep) => {
                // A path: `a::b::c`, not one that continues another path.
                let continues = i > 0 && tokens[i - 1] == Tok::Sep;
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while tokens.get(j) == Some(&Tok::Sep) {
                    match tokens.get(j + 1) {
                        Some(Tok::Ident(next)) => {
                            path.push(next.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                if !continues {
                    facts.named.push((here.clone(), path));
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    facts
}

/// True when `tokens` (an attribute's inside) is `cfg(test)` or a `cfg`
/// that needs `test` (`cfg(all(test, …))`).
fn is_cfg_test(tokens: &[Tok]) -> bool {
    let Some(Tok::Ident(first)) = tokens.first() else {
        return false;
    };
    if first != "cfg" {
        return false;
    }
    match tokens.get(2) {
        Some(Tok::Ident(w)) if w == "test" => true,
        Some(Tok::Ident(w)) if w == "all" => tokens
            .iter()
            .any(|t| matches!(t, Tok::Ident(w) if w == "test")),
        _ => false,
    }
}

/// `use` may start a statement (not `foo.use`, which is not Rust anyway,
/// but `pub use`, `pub(crate) use`).
fn starts_statement(tokens: &[Tok], i: usize) -> bool {
    i == 0
        || matches!(
            tokens[i - 1],
            Tok::Punct(';') | Tok::Punct('{') | Tok::Punct('}') | Tok::Punct(')') | Tok::Punct(']')
        )
        || matches!(&tokens[i - 1], Tok::Ident(w) if w == "pub")
}

/// The index of the bracket that closes the one at `open`.
fn matching(tokens: &[Tok], open: usize, o: char, c: char) -> usize {
    let mut depth = 0;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        if *t == Tok::Punct(o) {
            depth += 1;
        } else if *t == Tok::Punct(c) {
            depth -= 1;
            if depth == 0 {
                return k;
            }
        }
    }
    tokens.len() - 1
}

/// Skips one item from `i` (after its attributes): to its `;`, or past
/// its braced body, whichever comes first at its own level.
fn skip_item(tokens: &[Tok], mut i: usize) -> usize {
    while i < tokens.len() {
        match tokens[i] {
            Tok::Punct(';') => return i + 1,
            Tok::Punct('{') => return matching(tokens, i, '{', '}') + 1,
            Tok::Punct('(') => i = matching(tokens, i, '(', ')') + 1,
            Tok::Punct('[') => i = matching(tokens, i, '[', ']') + 1,
            _ => i += 1,
        }
    }
    i
}

/// Expands a use tree into its leaves: each full path, and the name it
/// binds (none for a glob).
fn use_tree(
    tokens: &[Tok],
    prefix: &mut Vec<String>,
    leaves: &mut Vec<(Vec<String>, Option<String>)>,
) {
    // Split at top-level commas.
    let mut parts = Vec::new();
    let (mut start, mut depth) = (0, 0);
    for (k, t) in tokens.iter().enumerate() {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth -= 1,
            Tok::Punct(',') if depth == 0 => {
                parts.push(&tokens[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&tokens[start..]);
    for part in parts {
        let base = prefix.len();
        let mut k = 0;
        // A leading `::` (a crate by its name) changes nothing here.
        if part.first() == Some(&Tok::Sep) {
            k = 1;
        }
        while k < part.len() {
            match &part[k] {
                Tok::Ident(w) if w == "as" => {
                    if let Some(Tok::Ident(alias)) = part.get(k + 1) {
                        let mut path = prefix.clone();
                        if path.last().is_some_and(|l| l == "self") {
                            path.pop();
                        }
                        leaves.push((path, Some(alias.clone())));
                    }
                    k = part.len();
                    prefix.truncate(base);
                    break;
                }
                Tok::Ident(w) => {
                    prefix.push(w.clone());
                    k += 1;
                }
                Tok::Sep => k += 1,
                Tok::Punct('{') => {
                    let end = matching(part, k, '{', '}');
                    use_tree(&part[k + 1..end], prefix, leaves);
                    k = part.len() + 1;
                }
                Tok::Punct('*') => {
                    leaves.push((prefix.clone(), None));
                    k = part.len() + 1;
                }
                _ => k += 1,
            }
        }
        if k == part.len() && prefix.len() > base {
            let mut path = prefix.clone();
            if path.last().is_some_and(|l| l == "self") {
                path.pop();
            }
            let bound = path.last().cloned();
            leaves.push((path, bound));
        }
        prefix.truncate(base);
    }
}

// ------------------------------------------------------------------ a crate's modules

/// One crate's files, by module path, and what each says.
struct Crate {
    /// The crate's name as other crates of the package write it (`berth`).
    name: String,
    files: BTreeMap<ModPath, PathBuf>,
    facts: BTreeMap<PathBuf, FileFacts>,
    /// `#[cfg(test)] mod x;` files: not part of the product.
    skipped: BTreeSet<PathBuf>,
}

impl Crate {
    /// Reads the crate whose root file is `root`, following its `mod`
    /// declarations.
    fn read(name: &str, root: &Path) -> Crate {
        let mut krate = Crate {
            name: name.to_string(),
            files: BTreeMap::new(),
            facts: BTreeMap::new(),
            skipped: BTreeSet::new(),
        };
        let mut queue = vec![(Vec::<String>::new(), root.to_path_buf())];
        while let Some((module, file)) = queue.pop() {
            let text = fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            let facts = read_facts(&tokens(&text), &module);
            // Where this file's child modules live.
            let dir = if module.is_empty()
                || file
                    .file_name()
                    .is_some_and(|n| n == "mod.rs" || n == "lib.rs")
            {
                file.parent().expect("a file has a folder").to_path_buf()
            } else {
                file.with_extension("")
            };
            for (parent, child) in &facts.declared {
                let mut path = parent.clone();
                path.push(child.clone());
                // Inline modules' children live in folders named after them.
                let mut folder = dir.clone();
                for seg in &parent[module.len()..] {
                    folder.push(seg);
                }
                let flat = folder.join(format!("{child}.rs"));
                let nested = folder.join(child).join("mod.rs");
                let found = if flat.exists() { flat } else { nested };
                assert!(
                    found.exists(),
                    "{}: `mod {child};` has no file",
                    file.display()
                );
                queue.push((path, found));
            }
            krate.files.insert(module, file.clone());
            krate.facts.insert(file, facts);
        }
        krate
    }

    /// The test modules' files, found by reading every `.rs` file under
    /// `dir` that no `mod` reached.
    fn unreached(&mut self, dir: &Path) -> Vec<PathBuf> {
        let reached: BTreeSet<&PathBuf> = self.files.values().collect();
        let mut all = Vec::new();
        rust_files(dir, &mut all);
        let left: Vec<PathBuf> = all.into_iter().filter(|f| !reached.contains(f)).collect();
        self.skipped.extend(left.iter().cloned());
        left
    }

    /// The module of `file`.
    fn module_of(&self, file: &Path) -> &ModPath {
        self.files
            .iter()
            .find(|(_, f)| f.as_path() == file)
            .map(|(m, _)| m)
            .expect("a file of this crate")
    }

    /// The file `path` (written in `module`) names, following `use`
    /// bindings; `None` for another crate's path or one that names no
    /// file of this crate.
    fn resolve(&self, module: &ModPath, path: &[String], others: &[&Crate]) -> Option<PathBuf> {
        self.resolve_depth(module, path, others, 0)
    }

    fn resolve_depth(
        &self,
        module: &ModPath,
        path: &[String],
        others: &[&Crate],
        depth: usize,
    ) -> Option<PathBuf> {
        if depth > 8 || path.is_empty() {
            return None;
        }
        let mut abs: ModPath = Vec::new();
        let mut rest = path;
        match path[0].as_str() {
            "crate" => rest = &path[1..],
            "self" => {
                abs = module.clone();
                rest = &path[1..];
            }
            "super" => {
                abs = module.clone();
                while rest.first().is_some_and(|s| s == "super") {
                    abs.pop();
                    rest = &rest[1..];
                }
            }
            first => {
                if let Some(other) = others.iter().find(|c| c.name == first) {
                    return other.resolve_depth(&Vec::new(), &path[1..], &[], depth + 1);
                }
                let mut child = module.clone();
                child.push(first.to_string());
                if self.files.contains_key(&child) {
                    abs = module.clone();
                } else if let Some(target) = self.binding(module, first) {
                    // A name this module binds with `use`.
                    let mut followed = target.1.clone();
                    followed.extend(path[1..].iter().cloned());
                    return self.resolve_depth(&target.0, &followed, others, depth + 1);
                } else {
                    return None;
                }
            }
        }
        // The longest prefix that is a module with a file.
        abs.extend(rest.iter().cloned());
        let mut len = abs.len();
        loop {
            if let Some(file) = self.files.get(&abs[..len]) {
                // The next segment may be a name the module binds with `use`.
                if let Some(name) = abs.get(len)
                    && let Some(target) = self.binding(&abs[..len].to_vec(), name)
                {
                    let mut followed = target.1.clone();
                    followed.extend(abs[len + 1..].iter().cloned());
                    if let Some(found) = self.resolve_depth(&target.0, &followed, others, depth + 1)
                    {
                        return Some(found);
                    }
                }
                return Some(file.clone());
            }
            if len == 0 {
                return None;
            }
            len -= 1;
        }
    }

    /// The `use` binding of `name` in `module`: the module it is written
    /// in and its path.
    fn binding(&self, module: &ModPath, name: &str) -> Option<(ModPath, Vec<String>)> {
        let file = self.files.get(module)?;
        self.facts[file]
            .bindings
            .iter()
            .find(|(m, bound, _)| m == module && bound == name)
            .map(|(m, _, path)| (m.clone(), path.clone()))
    }

    /// Every arrow: file → file it names, with the paths that make it.
    fn arrows(&self, others: &[&Crate]) -> BTreeMap<(PathBuf, PathBuf), BTreeSet<String>> {
        let mut arrows: BTreeMap<(PathBuf, PathBuf), BTreeSet<String>> = BTreeMap::new();
        for (file, facts) in &self.facts {
            for (module, path) in &facts.named {
                let Some(target) = self.resolve(module, path, others) else {
                    continue;
                };
                if &target != file {
                    arrows
                        .entry((file.clone(), target))
                        .or_default()
                        .insert(path.join("::"));
                }
            }
        }
        arrows
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a readable folder").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

// ------------------------------------------------------------------ circles

/// The circles of `arrows` (strongly connected sets of two or more files),
/// leaving out the arrows from a file to a module that encloses it: a
/// module's own file is its children's namespace (`use super::Inner`),
/// which Rust asks for, not a loop of concerns.
fn circles(
    arrows: &BTreeMap<(PathBuf, PathBuf), BTreeSet<String>>,
    encloses: &dyn Fn(&Path, &Path) -> bool,
) -> Vec<Vec<PathBuf>> {
    let mut graph: BTreeMap<&PathBuf, Vec<&PathBuf>> = BTreeMap::new();
    for (from, to) in arrows.keys() {
        if encloses(to, from) {
            continue;
        }
        graph.entry(from).or_default().push(to);
        graph.entry(to).or_default();
    }
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        graph: &'a BTreeMap<&'a PathBuf, Vec<&'a PathBuf>>,
        index: HashMap<&'a PathBuf, usize>,
        low: HashMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        next: usize,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a PathBuf) {
        w.index.insert(v, w.next);
        w.low.insert(v, w.next);
        w.next += 1;
        w.stack.push(v);
        w.on_stack.insert(v);
        for &to in &w.graph[v] {
            if !w.index.contains_key(to) {
                visit(w, to);
                let low = w.low[v].min(w.low[to]);
                w.low.insert(v, low);
            } else if w.on_stack.contains(to) {
                let low = w.low[v].min(w.index[to]);
                w.low.insert(v, low);
            }
        }
        if w.low[v] == w.index[v] {
            let mut set = Vec::new();
            loop {
                let x = w.stack.pop().expect("v is on the stack");
                w.on_stack.remove(x);
                set.push(x.clone());
                if x == v {
                    break;
                }
            }
            if set.len() > 1 {
                set.sort();
                w.found.push(set);
            }
        }
    }
    let mut walk = Walk {
        graph: &graph,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v) {
            visit(&mut walk, v);
        }
    }
    walk.found
}

/// Whether module file `outer` encloses `inner` (is the `mod.rs`, `lib.rs`
/// or `main.rs` of a folder `inner` lies in).
fn encloses(outer: &Path, inner: &Path) -> bool {
    let Some(name) = outer.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let folder = match name {
        "mod.rs" | "lib.rs" | "main.rs" => outer.parent(),
        // `x.rs` with children in `x/`.
        _ => None,
    };
    let by_name = outer.with_extension("");
    folder.is_some_and(|f| inner.starts_with(f) && inner != outer)
        || (inner.starts_with(&by_name) && inner != outer)
}

// ------------------------------------------------------------------ the layers

/// The layers as `docs/internals/layers.md` writes them down: in order from
/// the ground up, each with the paths (files, or folders ending in `/`)
/// under `supervisor/src/` it holds.
fn layers(root: &Path) -> Vec<(String, Vec<String>)> {
    let page = root.join("docs/internals/layers.md");
    let text =
        fs::read_to_string(&page).unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
    let mut in_table = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("## ") {
            in_table = line.trim() == "## The layers";
            continue;
        }
        if !in_table || !line.starts_with('|') || line.contains("---") {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 3 || cells[0] == "rank" {
            continue;
        }
        let name = cells[1].trim_matches('`').to_string();
        let paths = cells[2]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        out.push((name, paths));
    }
    assert!(
        out.len() >= 5,
        "{} has no table under `## The layers`",
        page.display()
    );
    out
}

/// The rank of `file` (its index in `layers`), by the longest path that
/// holds it.
fn rank_of(layers: &[(String, Vec<String>)], src: &Path, file: &Path) -> Option<(usize, String)> {
    let rel = file
        .strip_prefix(src)
        .ok()?
        .to_string_lossy()
        .replace('\\', "/");
    let mut best: Option<(usize, usize, String)> = None;
    for (rank, (name, paths)) in layers.iter().enumerate() {
        for p in paths {
            let holds = if p.ends_with('/') {
                rel.starts_with(p.as_str())
            } else {
                rel == *p
            };
            if holds && best.as_ref().is_none_or(|(len, _, _)| p.len() > *len) {
                best = Some((p.len(), rank, name.clone()));
            }
        }
    }
    best.map(|(_, rank, name)| (rank, name))
}

fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn each_layer_names_only_layers_below_it() {
    let root = repo_root();
    let src = root.join("supervisor/src");
    let layers = layers(&root);
    let mut lib = Crate::read("berth", &src.join("lib.rs"));
    let bin = Crate::read("berth_bin", &src.join("main.rs"));
    let arrows = {
        let mut all = lib.arrows(&[]);
        all.extend(bin.arrows(&[&lib]));
        all
    };
    // Every product file sits in a layer.
    let mut all = Vec::new();
    rust_files(&src, &mut all);
    let test_files = lib.unreached(&src);
    let mut unplaced = Vec::new();
    for file in &all {
        if test_files.contains(file) && !bin.files.values().any(|f| f == file) {
            continue;
        }
        if file == &src.join("lib.rs") {
            continue;
        }
        if rank_of(&layers, &src, file).is_none() {
            unplaced.push(shown(&root, file));
        }
    }
    assert!(
        unplaced.is_empty(),
        "files no layer of docs/internals/layers.md holds (add them to its table): {unplaced:?}"
    );
    let mut upward = Vec::new();
    for ((from, to), paths) in &arrows {
        // The crate root hands every layer's names on: it is above them all.
        if to.ends_with("supervisor/src/lib.rs") || from.ends_with("supervisor/src/lib.rs") {
            continue;
        }
        let (Some((from_rank, from_layer)), Some((to_rank, to_layer))) =
            (rank_of(&layers, &src, from), rank_of(&layers, &src, to))
        else {
            continue;
        };
        if to_rank > from_rank {
            upward.push(format!(
                "{} ({from_layer}) names {} ({to_layer}): {}",
                shown(&root, from),
                shown(&root, to),
                paths.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    assert!(
        upward.is_empty(),
        "a lower layer names a higher one ({} arrows; the order is docs/internals/layers.md's):\n{}",
        upward.len(),
        upward.join("\n")
    );
    let _ = lib.module_of(&src.join("lib.rs"));
}

#[test]
fn no_crate_has_an_import_circle() {
    let root = repo_root();
    let mut found = Vec::new();
    let lib = Crate::read("berth", &root.join("supervisor/src/lib.rs"));
    let crates = [
        ("berth", &lib, vec![]),
        (
            "berth bin",
            &Crate::read("berth_bin", &root.join("supervisor/src/main.rs")),
            vec![&lib],
        ),
        (
            "berth-protocol",
            &Crate::read("berth_protocol", &root.join("protocol/src/lib.rs")),
            vec![],
        ),
        (
            "berth-worker",
            &Crate::read("berth_worker", &root.join("worker/src/lib.rs")),
            vec![],
        ),
    ];
    for (name, krate, others) in &crates {
        let arrows = krate.arrows(others);
        for circle in circles(&arrows, &encloses) {
            let ties: Vec<String> = arrows
                .iter()
                .filter(|((a, b), _)| circle.contains(a) && circle.contains(b) && !encloses(b, a))
                .map(|((a, b), paths)| {
                    format!(
                        "  {} -> {}: {}",
                        shown(&root, a),
                        shown(&root, b),
                        paths.iter().cloned().collect::<Vec<_>>().join(", ")
                    )
                })
                .collect();
            found.push(format!(
                "{name}: {} files in a circle:\n{}",
                circle.len(),
                ties.join("\n")
            ));
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The reader itself, on the shapes it must know.
#[test]
fn the_reader_sees_uses_paths_and_skips_tests_and_literals() {
    let src = r##"
        //! crate::nowhere in a doc comment
        use crate::a::{b::{self, C}, d as e, f::*};
        pub(crate) use super::g::H;
        mod child;
        #[cfg(test)]
        mod tests;
        #[cfg(test)]
        mod inline_tests { use crate::hidden::X; }
        mod inner { fn f() { crate::inside::Y::new(); } }
        fn f<'a>(x: &'a str) -> char {
            let _ = "crate::in_a_string";
            let _ = r#"crate::raw"#;
            let _ = crate::z::call();
            '"'
        }
    "##;
    let module = vec!["m".to_string()];
    let facts = read_facts(&tokens(src), &module);
    let named: BTreeSet<String> = facts.named.iter().map(|(_, p)| p.join("::")).collect();
    for want in [
        "crate::a::b",
        "crate::a::b::C",
        "crate::a::d",
        "crate::a::f",
        "super::g::H",
        "crate::inside::Y::new",
        "crate::z::call",
    ] {
        assert!(named.contains(want), "missing {want} in {named:?}");
    }
    for unwanted in [
        "crate::nowhere",
        "crate::hidden::X",
        "crate::in_a_string",
        "crate::raw",
    ] {
        assert!(
            !named.iter().any(|n| n.starts_with(unwanted)),
            "{unwanted} read in {named:?}"
        );
    }
    let bound: BTreeSet<&str> = facts.bindings.iter().map(|(_, b, _)| b.as_str()).collect();
    assert_eq!(bound, BTreeSet::from(["b", "C", "e", "H"]));
    assert_eq!(facts.declared, vec![(module.clone(), "child".to_string())]);
    let inner = facts
        .named
        .iter()
        .find(|(_, p)| p.join("::") == "crate::inside::Y::new")
        .expect("the inline module's path");
    assert_eq!(inner.0, vec!["m".to_string(), "inner".to_string()]);
}
