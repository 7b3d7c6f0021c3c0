//! The catalogue: which models exist, how they are checked when they are
//! registered, and what a client may learn of them.

use super::slot::{Change, Entry, Slot};
use super::{CatalogueEntry, EventKind, ModelState, State, Supervisor};
use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::report::UnloadReport;

impl Supervisor {
    /// Adds a model to the catalogue (or replaces an unloaded one's spec).
    /// It loads on its first request, or with [`Supervisor::load_registered`].
    pub fn register(&self, spec: ModelSpec) -> Result<()> {
        self.register_as(spec, true)
    }

    /// Registers a model an in-place upgrade handed over, as the previous
    /// program had registered it: its fields are checked, but its worker
    /// program is not asked for its backends again (that starts the
    /// program, a Python interpreter for a Python worker, while new
    /// connections wait for the new program to accept).
    pub(crate) fn register_handed_over(&self, spec: ModelSpec) -> Result<()> {
        self.register_as(spec, false)
    }

    fn register_as(&self, mut spec: ModelSpec, ask_program: bool) -> Result<()> {
        if spec.backend.is_empty() && spec.http_spec(&self.config()).is_some() {
            spec.backend = crate::child::handle::HTTP_BACKEND.into();
        }
        if ask_program {
            self.check_spec(&spec)?;
        } else {
            spec.validate_for(&self.config())?;
        }
        let mut state = self.lock();
        if let Some(slot) = state.slots.get(&spec.name) {
            let pid = slot.worker.as_ref().map(|w| w.pid()).unwrap_or(0);
            return Err(Error::AlreadyLoaded {
                model: spec.name.clone(),
                pid,
            });
        }
        let name = spec.name.clone();
        // Names and aliases are one namespace: none may name two models.
        // Looked up in the index: bounded work under the lock, whatever
        // the catalogue holds.
        check_names(&state, &spec)?;
        let max = self.config().max_models;
        if !state.catalogue.contains_key(&name) && state.catalogue.len() >= max {
            return Err(Error::CatalogueFull { model: name, max });
        }
        let old = state.catalogue.remove(&name);
        index_aliases(
            &mut state,
            &name,
            old.as_ref()
                .map(|e| e.spec.aliases.as_slice())
                .unwrap_or_default(),
            &spec.aliases,
        );
        let entry = Entry::carry_over(
            old,
            spec,
            self.config().default_keep_alive,
            Change::Register,
        );
        state.catalogue.insert(name.clone(), entry);
        drop(state);
        self.emit(EventKind::Registered { model: name });
        Ok(())
    }

    /// Everything about `spec` that can be checked without loading it: its
    /// fields and ranges, its worker kind, that its worker program can be
    /// found and offers its backend.
    pub(super) fn check_spec(&self, spec: &ModelSpec) -> Result<()> {
        spec.validate_for(&self.config())?;
        let program = crate::child::program::worker_program(spec, &self.config())?;
        if program.wire == crate::child::program::Wire::Http {
            // A server is not asked for backends; its command is checked
            // for its placeholders (a fixed port's freedom at each start).
            // (What it reserved is given back as it is dropped.)
            let http = program.http.as_ref();
            let checked = crate::child::upstream::prepare(
                "",
                &program.args,
                spec.model.as_deref(),
                http.and_then(|h| h.port),
                http.is_some_and(|h| h.find_port),
                http.and_then(|h| h.host.as_deref()),
            )
            .map(drop);
            return checked.map_err(|reason| Error::InvalidSpec {
                model: spec.name.clone(),
                reason,
            });
        }
        let Ok(offered) = crate::child::probe::offered_backends(&program) else {
            // The load will say what is wrong with the program.
            return Ok(());
        };
        let Some(backend) = offered.iter().find(|o| o.name == spec.backend) else {
            let names: Vec<&str> = offered.iter().map(|o| o.name.as_str()).collect();
            return Err(Error::InvalidSpec {
                model: spec.name.clone(),
                reason: format!(
                    "worker `{program}` has no backend `{}` (it offers: {})",
                    spec.backend,
                    names.join(", ")
                ),
            });
        };
        // Options the backend declared: another is refused now, not at load.
        if let Some(known) = &backend.options {
            let known: Vec<&str> = known.iter().map(String::as_str).collect();
            if let Some(reason) = spec.to_load_spec(None).unknown_options(&known) {
                return Err(Error::InvalidSpec {
                    model: spec.name.clone(),
                    reason,
                });
            }
        }
        Ok(())
    }

    /// Asks the default worker program, and every declared worker kind,
    /// which backends it offers: what `berth serve` checks before it says
    /// it is listening, so a missing or broken worker is found at start and
    /// not at the first request ([`crate::SupervisorConfig::check_workers`]).
    pub fn check_workers(&self) -> std::result::Result<(), String> {
        self.config().check_workers()
    }

    /// Removes a model from the catalogue, unloading it first if loaded.
    pub async fn deregister(&self, model: &str) -> Result<Option<UnloadReport>> {
        if !self.lock().catalogue.contains_key(model) {
            return Err(self.unknown(model));
        }
        let report = match self.unload(model).await {
            Ok(report) => Some(report),
            Err(Error::NotLoaded { .. }) => None,
            Err(e) => return Err(e),
        };
        let removed = {
            let mut state = self.lock();
            let removed = state.catalogue.remove(model);
            if let Some(entry) = &removed {
                index_aliases(&mut state, model, &entry.spec.aliases, &[]);
            }
            removed.is_some()
        };
        if removed {
            self.emit(EventKind::Deregistered {
                model: model.into(),
            });
        }
        Ok(report)
    }

    pub(crate) fn unknown(&self, model: &str) -> Error {
        Error::UnknownModel {
            model: model.into(),
            known: self.lock().catalogue.keys().cloned().collect(),
        }
    }

    /// The registered name `name` stands for: itself, or the model it is
    /// an alias of.
    pub fn canonical(&self, name: &str) -> String {
        let state = self.lock();
        if state.catalogue.contains_key(name) {
            return name.to_string();
        }
        state
            .aliases
            .get(name)
            .cloned()
            .unwrap_or_else(|| name.to_string())
    }

    /// Whether `model` is registered and served by an HTTP server (its
    /// requests are relayed, see [`Supervisor::lease`]).
    pub fn is_http_model(&self, model: &str) -> bool {
        self.lock()
            .catalogue
            .get(model)
            .is_some_and(|e| e.spec.http_spec(&self.config()).is_some())
    }

    /// Every registered model with its state.
    pub fn catalogue(&self) -> Vec<CatalogueEntry> {
        let state = self.lock();
        state
            .catalogue
            .iter()
            .map(|(name, entry)| {
                let slot = state.slots.get(name);
                CatalogueEntry {
                    spec: entry.spec.clone(),
                    state: slot.map(Slot::state).unwrap_or(ModelState::Unloaded),
                    pid: slot.and_then(|s| s.worker.as_ref()).map(|w| w.pid()),
                    last_peak_bytes: entry.last_peak_bytes,
                }
            })
            .collect()
    }

    /// Every registered model's spec, as registered.
    pub(crate) fn specs(&self) -> Vec<ModelSpec> {
        self.lock()
            .catalogue
            .values()
            .map(|entry| entry.spec.clone())
            .collect()
    }

    /// A registered model's state, as [`Supervisor::catalogue`] gives it.
    pub fn model_state(&self, model: &str) -> Option<ModelState> {
        let state = self.lock();
        state.catalogue.get(model)?;
        Some(
            state
                .slots
                .get(model)
                .map(Slot::state)
                .unwrap_or(ModelState::Unloaded),
        )
    }

    /// The spec a model is registered with.
    pub fn spec(&self, model: &str) -> Option<ModelSpec> {
        self.lock().catalogue.get(model).map(|e| e.spec.clone())
    }
}

/// Refuses `spec` if its name or one of its aliases already names another
/// model (as a name or an alias).
pub(super) fn check_names(state: &State, spec: &ModelSpec) -> Result<()> {
    for other in spec.aliases.iter().chain(std::iter::once(&spec.name)) {
        let holder = if state.catalogue.contains_key(other) {
            Some(other)
        } else {
            state.aliases.get(other)
        };
        if let Some(holder) = holder.filter(|h| **h != spec.name) {
            return Err(Error::InvalidSpec {
                model: spec.name.clone(),
                reason: format!("the name `{other}` is already model `{holder}`'s"),
            });
        }
    }
    Ok(())
}

/// The alias index after `model`'s aliases change from `old` to `new`.
pub(super) fn index_aliases(state: &mut State, model: &str, old: &[String], new: &[String]) {
    for alias in old {
        if state.aliases.get(alias).is_some_and(|m| m == model) {
            state.aliases.remove(alias);
        }
    }
    for alias in new {
        state.aliases.insert(alias.clone(), model.to_string());
    }
}

impl crate::config::SupervisorConfig {
    /// Asks the default worker program, and every declared worker kind,
    /// which backends it offers: what `berth serve` checks before it says
    /// it is listening, so a missing or broken worker is found at start and
    /// not at the first request (and at a reload, before anything changes).
    pub fn check_workers(&self) -> std::result::Result<(), String> {
        use crate::child::probe::offered_backends;
        use crate::child::program::{default_program, worker_program};
        let config = self;
        let mut programs = vec![default_program(config).map_err(|e| e.to_string())?];
        for (name, kind) in &config.workers {
            kind.check(name)?;
            if kind.http.is_some() {
                // An HTTP server is not a berth worker: nothing to ask.
                continue;
            }
            let mut spec = ModelSpec::new("check", "any");
            spec.worker = Some(name.clone());
            programs.push(worker_program(&spec, config).map_err(|e| e.to_string())?);
        }
        for program in programs {
            if let Err(why) = offered_backends(&program) {
                let advice = crate::child::handshake::cannot_start(std::slice::from_ref(&why))
                    .unwrap_or_else(|| {
                        "a worker program is a berth worker (`berth worker`, `berth-worker`, or \
                         a binary built on the berth-worker library, a `command` worker built \
                         on the berth_worker Python package), or a wrapper that execs one \
                         passing its arguments on"
                            .into()
                    });
                return Err(format!(
                    "worker program `{program}` did not answer `--backends` with its \
                     backends: {why}; {advice}"
                ));
            }
        }
        Ok(())
    }
}
