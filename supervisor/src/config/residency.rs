//! Which models may run together, as the operator says: groups and a
//! matrix of sets (llama-swap's `groups` and `matrix`, which `berth serve
//! --llama-swap` reads into these), and servers on one fixed port.
//!
//! ```toml
//! [groups.coding]              # at most one member at a time (swap),
//! members = ["qwen", "coder"]  # and nothing outside it (exclusive)
//! [groups.always]
//! members = ["embed"]
//! swap = false                 # its members run together
//! exclusive = false            # and beside others
//! persistent = true            # no exclusive group stops them
//!
//! # or, instead of groups: the sets that may run together
//! [matrix]
//! vars = { g = "gemma", v = "voxtral" }
//! sets = [{ name = "standard", expr = "(g | qwen) & v" }]
//! evict_costs = { v = 50 }     # stopping it costs more (a slow start)
//! ```
//!
//! The decision is [`Rules::must_stop`], pure: which running models stop
//! before a model starts. Within them, berth's budgets still hold.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// A group: llama-swap's semantics, its defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    pub members: Vec<String>,
    /// At most one member runs at a time (default true).
    #[serde(default = "yes")]
    pub swap: bool,
    /// Starting a member stops every model outside the group, but for
    /// persistent groups' (default true).
    #[serde(default = "yes")]
    pub exclusive: bool,
    /// No other group's exclusivity stops its members (default false).
    #[serde(default)]
    pub persistent: bool,
}

fn yes() -> bool {
    true
}

/// One named set of the matrix: an expression over model names and vars,
/// `|` (either) binding looser than `&` (both), parentheses, `+name` for
/// another set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedSet {
    pub name: String,
    pub expr: String,
}

/// The sets of models that may run together.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matrix {
    /// Short names for models, for the expressions.
    #[serde(default)]
    pub vars: BTreeMap<String, String>,
    /// In order: of sets that cost as much to switch to, the first wins.
    pub sets: Vec<NamedSet>,
    /// What stopping a model (or var) costs; 1 for those not named.
    #[serde(default)]
    pub evict_costs: BTreeMap<String, u64>,
}

/// The operator's rules as written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Residency {
    pub groups: BTreeMap<String, Group>,
    pub matrix: Option<Matrix>,
}

/// The rules checked and expanded: what the supervisor decides with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    groups: Vec<(String, Group)>,
    /// Each concrete set of the matrix, in order (`None`: no matrix).
    sets: Option<Vec<BTreeSet<String>>>,
    costs: BTreeMap<String, u64>,
}

/// Sets one expression may expand to: a matrix is a handful.
const MAX_SETS: usize = 4096;

impl Residency {
    /// Checks the rules against the models there are (`known`) and expands
    /// the matrix.
    pub fn compile(&self, known: &dyn Fn(&str) -> bool) -> Result<Rules, String> {
        if !self.groups.is_empty() && self.matrix.is_some() {
            return Err("give `groups` or a `matrix`, not both".into());
        }
        let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, group) in &self.groups {
            for member in &group.members {
                if !known(member) {
                    return Err(format!(
                        "group `{name}` names model `{member}`, which is not one"
                    ));
                }
                if let Some(other) = seen.insert(member, name) {
                    return Err(if other == name {
                        format!("group `{name}` lists model `{member}` twice")
                    } else {
                        format!("model `{member}` is in two groups, `{other}` and `{name}`")
                    });
                }
            }
        }
        let mut rules = Rules {
            groups: self
                .groups
                .iter()
                .map(|(n, g)| (n.clone(), g.clone()))
                .collect(),
            ..Rules::default()
        };
        if let Some(matrix) = &self.matrix {
            let (sets, costs) = expand_matrix(matrix, known).map_err(|e| format!("matrix: {e}"))?;
            rules.sets = Some(sets);
            rules.costs = costs;
        }
        Ok(rules)
    }
}

impl Rules {
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.sets.is_none()
    }

    /// The running models that must stop before `target` starts: those on
    /// its fixed port (`port`), then the groups' or the matrix's say.
    pub fn must_stop(
        &self,
        target: &str,
        running: &[String],
        port: &dyn Fn(&str) -> Option<u16>,
    ) -> Vec<String> {
        let others = running.iter().filter(|m| *m != target);
        let mut out: Vec<String> = match port(target) {
            Some(p) => others
                .clone()
                .filter(|m| port(m) == Some(p))
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        let mut add = |m: &String| {
            if !out.contains(m) {
                out.push(m.clone());
            }
        };
        if let Some(sets) = &self.sets {
            if running.iter().any(|m| m == target) {
                return out;
            }
            let cost = |m: &String| self.costs.get(m).copied().unwrap_or(1);
            let best = sets.iter().filter(|s| s.contains(target)).min_by_key(|s| {
                others
                    .clone()
                    .filter(|m| !s.contains(*m))
                    .map(cost)
                    .sum::<u64>()
            });
            // In no set: it runs alone.
            others
                .filter(|m| best.is_none_or(|s| !s.contains(*m)))
                .for_each(&mut add);
            return out;
        }
        let group_of = |m: &str| {
            self.groups
                .iter()
                .find(|(_, g)| g.members.iter().any(|x| x == m))
        };
        let Some((name, group)) = group_of(target) else {
            return out;
        };
        for m in others {
            let stop = match group_of(m) {
                Some((other, _)) if other == name => group.swap,
                Some((_, other)) => group.exclusive && !other.persistent,
                None => group.exclusive,
            };
            if stop {
                add(m);
            }
        }
        out
    }

    /// The sets of models the rules let run together at their largest: each
    /// matrix set, each group that does not swap; for the start's check
    /// that the budgets can hold them.
    pub fn together(&self) -> Vec<(String, Vec<String>)> {
        match &self.sets {
            Some(sets) => sets
                .iter()
                .map(|s| {
                    let v: Vec<String> = s.iter().cloned().collect();
                    (format!("set {{{}}}", v.join(", ")), v)
                })
                .collect(),
            None => self
                .groups
                .iter()
                .filter(|(_, g)| !g.swap)
                .map(|(n, g)| (format!("group `{n}`"), g.members.clone()))
                .collect(),
        }
    }
}

/// The matrix's sets, each expanded to the concrete sets of models it
/// allows, in order; and each model's eviction cost.
fn expand_matrix(
    matrix: &Matrix,
    known: &dyn Fn(&str) -> bool,
) -> Result<(Sets, BTreeMap<String, u64>), String> {
    if matrix.sets.is_empty() {
        return Err("it must define at least one set".into());
    }
    for (var, model) in &matrix.vars {
        if var.is_empty() || !var.chars().all(|c| c.is_alphanumeric() || "-.".contains(c)) {
            return Err(format!("var `{var}` must be letters, digits, `-` or `.`"));
        }
        if !known(model) {
            return Err(format!(
                "var `{var}` names model `{model}`, which is not one"
            ));
        }
    }
    let mut costs = BTreeMap::new();
    for (key, cost) in &matrix.evict_costs {
        let model = matrix.vars.get(key).cloned().unwrap_or_else(|| key.clone());
        if !known(&model) {
            return Err(format!(
                "evict_costs names `{key}`, which is no var or model"
            ));
        }
        if *cost == 0 {
            return Err(format!("the evict cost of `{key}` must be at least 1"));
        }
        costs.insert(model, *cost);
    }
    let by_name: BTreeMap<&str, &str> = matrix
        .sets
        .iter()
        .map(|s| (s.name.as_str(), s.expr.as_str()))
        .collect();
    let mut out = Vec::new();
    for set in &matrix.sets {
        let mut expanding = vec![set.name.clone()];
        let expanded = parse(
            &set.expr,
            &mut Ctx {
                vars: &matrix.vars,
                sets: &by_name,
                known,
                expanding: &mut expanding,
            },
        )
        .map_err(|e| format!("set `{}`: {e}", set.name))?;
        for s in expanded {
            if !out.contains(&s) {
                out.push(s);
            }
        }
        if out.len() > MAX_SETS {
            return Err(format!(
                "its sets expand to more than {MAX_SETS} combinations"
            ));
        }
    }
    Ok((out, costs))
}

struct Ctx<'a> {
    vars: &'a BTreeMap<String, String>,
    sets: &'a BTreeMap<&'a str, &'a str>,
    known: &'a dyn Fn(&str) -> bool,
    /// Sets being expanded, to refuse a cycle.
    expanding: &'a mut Vec<String>,
}

type Sets = Vec<BTreeSet<String>>;

/// `or := and ('|' and)*`, the whole expression.
fn parse(expr: &str, ctx: &mut Ctx<'_>) -> Result<Sets, String> {
    let tokens = tokenize(expr)?;
    if tokens.is_empty() {
        return Err("the expression is empty".into());
    }
    let mut at = 0;
    let sets = or(&tokens, &mut at, ctx)?;
    if let Some(t) = tokens.get(at) {
        return Err(format!("unexpected `{t}` after the expression"));
    }
    Ok(sets)
}

fn tokenize(expr: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '|' | '&' | '(' | ')' | '+' => out.push(c.to_string()),
            c if c.is_alphanumeric() || "_-.".contains(c) => {
                let mut word = c.to_string();
                while let Some((_, c)) = chars.peek().copied()
                    && (c.is_alphanumeric() || "_-.".contains(c))
                {
                    word.push(c);
                    chars.next();
                }
                out.push(word);
            }
            c => return Err(format!("unexpected character `{c}` at {i}")),
        }
    }
    Ok(out)
}

fn or(tokens: &[String], at: &mut usize, ctx: &mut Ctx<'_>) -> Result<Sets, String> {
    let mut sets = and(tokens, at, ctx)?;
    while tokens.get(*at).is_some_and(|t| t == "|") {
        *at += 1;
        for s in and(tokens, at, ctx)? {
            if !sets.contains(&s) {
                sets.push(s);
            }
        }
    }
    Ok(sets)
}

fn and(tokens: &[String], at: &mut usize, ctx: &mut Ctx<'_>) -> Result<Sets, String> {
    let mut sets = atom(tokens, at, ctx)?;
    while tokens.get(*at).is_some_and(|t| t == "&") {
        *at += 1;
        let right = atom(tokens, at, ctx)?;
        let mut product = Vec::new();
        for l in &sets {
            for r in &right {
                let s: BTreeSet<String> = l.union(r).cloned().collect();
                if !product.contains(&s) {
                    product.push(s);
                }
                if product.len() > MAX_SETS {
                    return Err(format!("it expands to more than {MAX_SETS} combinations"));
                }
            }
        }
        sets = product;
    }
    Ok(sets)
}

fn atom(tokens: &[String], at: &mut usize, ctx: &mut Ctx<'_>) -> Result<Sets, String> {
    let Some(token) = tokens.get(*at) else {
        return Err("it ends where a name was expected".into());
    };
    *at += 1;
    match token.as_str() {
        "(" => {
            let sets = or(tokens, at, ctx)?;
            if tokens.get(*at).is_none_or(|t| t != ")") {
                return Err("a `(` is not closed".into());
            }
            *at += 1;
            Ok(sets)
        }
        "+" => {
            let Some(name) = tokens.get(*at) else {
                return Err("`+` names no set".into());
            };
            *at += 1;
            let Some(expr) = ctx.sets.get(name.as_str()).copied() else {
                return Err(format!("`+{name}` names no set"));
            };
            if ctx.expanding.contains(name) {
                return Err(format!("set `{name}` includes itself"));
            }
            ctx.expanding.push(name.clone());
            let sets = parse(expr, ctx);
            ctx.expanding.pop();
            sets
        }
        "|" | "&" | ")" => Err(format!("unexpected `{token}`")),
        name => {
            let model = ctx.vars.get(name).map(String::as_str).unwrap_or(name);
            if !(ctx.known)(model) {
                return Err(format!("`{name}` is no var or model"));
            }
            Ok(vec![BTreeSet::from([model.to_string()])])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn group(members: &[&str], swap: bool, exclusive: bool, persistent: bool) -> Group {
        Group {
            members: names(members),
            swap,
            exclusive,
            persistent,
        }
    }

    const NO_PORT: &dyn Fn(&str) -> Option<u16> = &|_| None;

    /// llama-swap's example: group1 swaps and is exclusive, group2 runs
    /// together beside others, `forever` is persistent.
    #[test]
    fn groups_stop_what_llama_swap_stops() {
        let residency = Residency {
            groups: BTreeMap::from([
                (
                    "group1".into(),
                    group(&["llama", "qwen"], true, true, false),
                ),
                (
                    "group2".into(),
                    group(&["docker", "a", "b"], false, false, false),
                ),
                ("forever".into(), group(&["fa", "fb"], false, false, true)),
            ]),
            matrix: None,
        };
        let rules = residency.compile(&|_| true).unwrap();
        let running = names(&["qwen", "docker", "a", "fa"]);
        // group1's member: its sibling (swap) and group2 (exclusive) go;
        // the persistent group stays.
        assert_eq!(
            rules.must_stop("llama", &running, NO_PORT),
            names(&["qwen", "docker", "a"])
        );
        // group2 is neither: nothing goes.
        assert!(rules.must_stop("b", &running, NO_PORT).is_empty());
        // A model in no group is not touched by groups.
        assert!(rules.must_stop("other", &running, NO_PORT).is_empty());
        assert_eq!(
            rules.together(),
            vec![
                ("group `forever`".to_string(), names(&["fa", "fb"])),
                ("group `group2`".to_string(), names(&["docker", "a", "b"])),
            ]
        );
    }

    #[test]
    fn one_fixed_port_is_one_server_at_a_time() {
        let rules = Rules::default();
        let port = |m: &str| match m {
            "a" | "b" => Some(8999),
            _ => None,
        };
        assert_eq!(
            rules.must_stop("a", &names(&["b", "c"]), &port),
            names(&["b"])
        );
        assert!(rules.must_stop("c", &names(&["a", "b"]), &port).is_empty());
    }

    #[test]
    fn the_matrix_picks_the_cheapest_set_and_stops_the_rest() {
        let matrix = Matrix {
            vars: BTreeMap::from([("g".into(), "gemma".into()), ("v".into(), "voxtral".into())]),
            sets: vec![
                NamedSet {
                    name: "standard".into(),
                    expr: "(g | qwen) & v".into(),
                },
                NamedSet {
                    name: "creative".into(),
                    expr: "(g|qwen) & sd".into(),
                },
                NamedSet {
                    name: "all".into(),
                    expr: "+standard & e".into(),
                },
            ],
            evict_costs: BTreeMap::from([("v".into(), 50)]),
        };
        let rules = Residency {
            groups: BTreeMap::new(),
            matrix: Some(matrix),
        }
        .compile(&|_| true)
        .unwrap();
        // voxtral costs 50 to stop, sd 1: gemma joins voxtral.
        assert_eq!(
            rules.must_stop("gemma", &names(&["qwen", "voxtral", "sd"]), NO_PORT),
            names(&["qwen", "sd"])
        );
        // Running already: nothing stops.
        assert!(
            rules
                .must_stop("qwen", &names(&["qwen", "sd"]), NO_PORT)
                .is_empty()
        );
        // In no set: it runs alone.
        assert_eq!(
            rules.must_stop("lone", &names(&["qwen", "sd"]), NO_PORT),
            names(&["qwen", "sd"])
        );
        assert_eq!(rules.together().len(), 2 + 2 + 2);
    }

    #[test]
    fn bad_rules_are_named() {
        let known = |m: &str| m != "ghost";
        let bad = |r: Residency| r.compile(&known).unwrap_err();
        let g = |m: &[&str]| group(m, true, true, false);
        assert!(
            bad(Residency {
                groups: BTreeMap::from([("x".into(), g(&["ghost"]))]),
                matrix: None
            })
            .contains("group `x` names model `ghost`")
        );
        assert!(
            bad(Residency {
                groups: BTreeMap::from([("x".into(), g(&["a"])), ("y".into(), g(&["a"]))]),
                matrix: None
            })
            .contains("model `a` is in two groups")
        );
        let m = |expr: &str| Residency {
            groups: BTreeMap::new(),
            matrix: Some(Matrix {
                sets: vec![
                    NamedSet {
                        name: "s".into(),
                        expr: expr.into(),
                    },
                    NamedSet {
                        name: "t".into(),
                        expr: "+s".into(),
                    },
                ],
                ..Matrix::default()
            }),
        };
        for (expr, said) in [
            ("a & (b", "not closed"),
            ("a & ghost", "`ghost` is no var or model"),
            ("a / b", "unexpected character `/`"),
            ("+t", "includes itself"),
            ("", "empty"),
            ("a b", "unexpected `b`"),
        ] {
            let err = bad(m(expr));
            assert!(err.contains(said), "{expr}: {err}");
        }
        // 2^13 combinations are refused, not built.
        let wide = (0..13)
            .map(|i| format!("(a{i} | b{i})"))
            .collect::<Vec<_>>()
            .join(" & ");
        assert!(bad(m(&wide)).contains("more than 4096"));
    }
}
