//! Typed access to a spec's `KEY=VALUE` options, with errors that name the
//! model, the key and what was expected.

use std::str::FromStr;

use berth_protocol::{ErrorKind, LoadSpec, WireError};

/// Typed view of [`LoadSpec::options`].
#[derive(Debug)]
pub struct Options<'a> {
    spec: &'a LoadSpec,
}

impl<'a> Options<'a> {
    pub fn new(spec: &'a LoadSpec) -> Self {
        Options { spec }
    }

    /// The option parsed as `T`, or `None` when absent.
    pub fn get<T: FromStr>(&self, key: &str) -> Result<Option<T>, WireError> {
        let Some(raw) = self.spec.options.get(key) else {
            return Ok(None);
        };
        raw.trim().parse::<T>().map(Some).map_err(|_| {
            // Bad input, not a failed load: the caller gets a 400.
            WireError::new(
                ErrorKind::BadRequest,
                format!(
                    "model `{}`: option `{key}={raw}` is not a valid {} for backend `{}`",
                    self.spec.name,
                    std::any::type_name::<T>()
                        .rsplit("::")
                        .next()
                        .unwrap_or("value"),
                    self.spec.backend
                ),
            )
        })
    }

    /// The option parsed as `T`, or `default` when absent.
    pub fn get_or<T: FromStr>(&self, key: &str, default: T) -> Result<T, WireError> {
        Ok(self.get(key)?.unwrap_or(default))
    }

    /// The raw string value.
    pub fn str(&self, key: &str) -> Option<&'a str> {
        self.spec.options.get(key).map(String::as_str)
    }

    /// Refuses options the backend does not know, so a typo is an error
    /// rather than a silently ignored setting.
    pub fn only(&self, known: &[&str]) -> Result<(), WireError> {
        match self.spec.unknown_options(known) {
            None => Ok(()),
            Some(why) => Err(WireError::new(
                ErrorKind::BadRequest,
                format!("model `{}`: {why}", self.spec.name),
            )),
        }
    }
}
