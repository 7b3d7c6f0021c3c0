//! What a worker placed on GPUs is told about its share of a card, so that
//! the frameworks inside it take that share and no more.
//!
//! JAX (XLA's client) preallocates 75% of every visible card at its first
//! operation and keeps it for the life of the process: a second JAX worker
//! on the same card then fails at load, however small its model. PyTorch
//! allocates on demand and caches what it frees, so two PyTorch workers
//! share a card by default (and the cache is what an unload gives back).
//! So, for a worker berth places on GPUs:
//!
//! - with the model's `vram` declared, it gets `BERTH_VRAM_BYTES` and
//!   `XLA_PYTHON_CLIENT_MEM_FRACTION` set to that share of the card, rounded
//!   down: JAX preallocates exactly its share, which placement has reserved
//!   within `gpu_memory_budget`;
//! - without it, `XLA_PYTHON_CLIENT_PREALLOCATE=false`: JAX allocates as it
//!   goes, berth measures what the worker really holds (and places the
//!   model by that next time), and with a `gpu_memory_budget` the fraction
//!   caps it at the budget's share of the card.
//!
//! Whatever the operator set in the worker kind's or the model's `env` is
//! left as it is: their word wins. It decides on figures it is given and
//! reads nothing itself.

/// The variable berth sets for the share of each card JAX may take. JAX has
/// two names for it, and exactly one may be set: JAX 0.11's CUDA plugin
/// refuses the pair ("XLA_CLIENT_MEM_FRACTION is specified together with
/// XLA_PYTHON_CLIENT_MEM_FRACTION. Remove the latter one, it is
/// deprecated.") and JAX then runs on the CPU alone, silently (measured on
/// an H100, docs/gpu.md). The older name is the one every release reads,
/// the newest with a deprecation notice; the newer name only recent ones.
const FRACTION: &str = "XLA_PYTHON_CLIENT_MEM_FRACTION";
/// The newer name, which berth never sets but respects when the operator
/// does.
const FRACTION_NEW: &str = "XLA_CLIENT_MEM_FRACTION";
const PREALLOCATE: &str = "XLA_PYTHON_CLIENT_PREALLOCATE";
/// The share berth reserved for the worker on each of its GPUs, in bytes,
/// for any framework (or backend) to read.
pub const VRAM_BYTES: &str = "BERTH_VRAM_BYTES";

/// The environment that tells the frameworks in a worker its share of each
/// card: `share`, the model's declared `vram`; `budget`, the per-GPU
/// budget; `total`, the memory of the largest of its cards (JAX applies
/// its fraction to each card's own memory; `None` when NVML could not say
/// for one of them); `set`, what the operator's env already holds.
pub fn framework_env(
    share: Option<u64>,
    budget: Option<u64>,
    total: Option<u64>,
    set: &[(String, String)],
) -> Vec<(String, String)> {
    let operator = |name: &str| set.iter().any(|(k, _)| k == name);
    let mut env = Vec::new();
    if let Some(share) = share {
        env.push((VRAM_BYTES.to_string(), share.to_string()));
    }
    let cap = share.or(budget);
    let fraction = match (cap, total) {
        (Some(cap), Some(total)) if total > 0 => Some(fraction_of(cap, total)),
        _ => None,
    };
    // The operator's either name stands for both: setting the other beside
    // it would put JAX on the CPU.
    let operator_fraction = operator(FRACTION) || operator(FRACTION_NEW);
    if let Some(fraction) = fraction.as_ref().filter(|_| !operator_fraction) {
        env.push((FRACTION.to_string(), fraction.clone()));
    }
    // Preallocating is right only for a share berth told it: else JAX's
    // default (75% of the card) is no one's to take.
    if (share.is_none() || (fraction.is_none() && !operator_fraction)) && !operator(PREALLOCATE) {
        env.push((PREALLOCATE.to_string(), "false".into()));
    }
    env
}

/// Why an environment that sets both of JAX's fraction names cannot work
/// (`names`: the variables it sets); `None` when it sets at most one.
pub fn fraction_conflict<'a>(mut names: impl Iterator<Item = &'a str>) -> Option<String> {
    let (mut new, mut old) = (false, false);
    for name in names.by_ref() {
        new |= name == FRACTION_NEW;
        old |= name == FRACTION;
    }
    (new && old).then(|| {
        format!(
            "env sets both `{FRACTION_NEW}` and `{FRACTION}`: JAX 0.11 refuses the pair and \
             runs on the CPU alone; keep one of them"
        )
    })
}

/// The card size a fraction is worked out against, for a worker on cards of
/// these sizes: JAX takes its fraction of each card's own memory, so the
/// largest card decides the fraction that keeps it within its share on
/// every one; with a card of unknown size, none.
pub fn fraction_base(totals: &[Option<u64>]) -> Option<u64> {
    totals
        .iter()
        .copied()
        .collect::<Option<Vec<u64>>>()?
        .into_iter()
        .max()
}

/// `part / total` rounded down to three decimals (so the framework never
/// takes more than its share), at least 0.001 and at most 1.
fn fraction_of(part: u64, total: u64) -> String {
    let thousandths = (u128::from(part) * 1000 / u128::from(total)).clamp(1, 1000);
    format!("{}.{:03}", thousandths / 1000, thousandths % 1000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GIB;

    fn get<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
        env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_declared_share_becomes_jax_s_fraction_of_the_card() {
        let env = framework_env(Some(20 * GIB), Some(60 * GIB), Some(80 * GIB), &[]);
        assert_eq!(get(&env, "XLA_PYTHON_CLIENT_MEM_FRACTION"), Some("0.250"));
        // Never both names: JAX 0.11 refuses the pair and runs on the CPU.
        assert_eq!(get(&env, "XLA_CLIENT_MEM_FRACTION"), None);
        assert_eq!(get(&env, VRAM_BYTES), Some("21474836480"));
        // JAX preallocates its share: no growth on demand.
        assert_eq!(get(&env, PREALLOCATE), None);
        // Rounded down, never up, never 0, never past the card.
        assert_eq!(fraction_of(GIB, 3 * GIB), "0.333");
        assert_eq!(fraction_of(1, 80 * GIB), "0.001");
        assert_eq!(fraction_of(90 * GIB, 80 * GIB), "1.000");
    }

    #[test]
    fn without_a_share_jax_grows_on_demand_within_the_budget() {
        let env = framework_env(None, Some(40 * GIB), Some(80 * GIB), &[]);
        assert_eq!(get(&env, PREALLOCATE), Some("false"));
        assert_eq!(get(&env, "XLA_PYTHON_CLIENT_MEM_FRACTION"), Some("0.500"));
        assert_eq!(get(&env, VRAM_BYTES), None);
        let env = framework_env(None, None, Some(80 * GIB), &[]);
        assert_eq!(env, [(PREALLOCATE.to_string(), "false".to_string())]);
        // NVML could not give the card's size: no fraction is made up, and
        // JAX must not take its default 75% either.
        let env = framework_env(Some(GIB), None, None, &[]);
        assert_eq!(get(&env, "XLA_PYTHON_CLIENT_MEM_FRACTION"), None);
        assert_eq!(get(&env, VRAM_BYTES), Some("1073741824"));
        assert_eq!(get(&env, PREALLOCATE), Some("false"));
    }

    #[test]
    fn on_cards_of_two_sizes_the_share_holds_on_the_largest() {
        // 12 GiB on a 24 GiB and an 80 GiB card: 0.150 of each, never 0.500
        // (40 GiB of the large one).
        let base = fraction_base(&[Some(24 * GIB), Some(80 * GIB)]);
        assert_eq!(base, Some(80 * GIB));
        let env = framework_env(Some(12 * GIB), None, base, &[]);
        assert_eq!(get(&env, "XLA_PYTHON_CLIENT_MEM_FRACTION"), Some("0.150"));
        assert_eq!(fraction_base(&[Some(80 * GIB), None]), None);
    }

    #[test]
    fn both_fraction_names_together_are_refused() {
        let both = [
            "PATH",
            "XLA_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_MEM_FRACTION",
        ];
        let why = fraction_conflict(both.into_iter()).unwrap();
        assert!(why.contains("runs on the CPU"), "{why}");
        assert_eq!(fraction_conflict(both[..2].iter().copied()), None);
        assert_eq!(fraction_conflict(both[2..].iter().copied()), None);
    }

    #[test]
    fn what_the_operator_set_is_left_alone() {
        let set = [
            (
                "XLA_PYTHON_CLIENT_MEM_FRACTION".to_string(),
                "0.9".to_string(),
            ),
            (PREALLOCATE.to_string(), "true".to_string()),
        ];
        let env = framework_env(None, Some(40 * GIB), Some(80 * GIB), &set);
        assert!(env.is_empty(), "{env:?}");
        let env = framework_env(Some(20 * GIB), None, Some(80 * GIB), &set);
        assert_eq!(env, [(VRAM_BYTES.to_string(), (20 * GIB).to_string())]);
        // The operator's newer name alone: berth adds not the older one,
        // which would make the pair JAX refuses.
        let set = [("XLA_CLIENT_MEM_FRACTION".to_string(), "0.3".to_string())];
        let env = framework_env(Some(20 * GIB), None, Some(80 * GIB), &set);
        assert_eq!(get(&env, "XLA_PYTHON_CLIENT_MEM_FRACTION"), None, "{env:?}");
    }
}
