//! Where a model's files may be: a path confined to the models directory,
//! checked with every symlink resolved, saying nothing of the host to a
//! client that named a path outside.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// `path` (a relative one taken inside `root`) with every symlink
/// resolved, if that lies inside `root` and is not `root` itself; else an
/// error. The error says no more of the host than the path it was given:
/// not whether a path outside exists, nor where a link points (those go to
/// the log), since the path may come from an HTTP client.
pub fn confined(model: &str, path: &std::path::Path, root: &std::path::Path) -> Result<PathBuf> {
    let refuse = |reason: String| Error::InvalidSpec {
        model: model.into(),
        reason,
    };
    let outside = || {
        refuse(format!(
            "path `{}` is outside the models directory; put the model inside it",
            path.display()
        ))
    };
    let root = root.canonicalize().map_err(|e| {
        tracing::warn!(root = %root.display(), "cannot resolve the models directory: {e}");
        refuse("the models directory cannot be read; the operator must fix it".into())
    })?;
    let joined = if path.is_relative() {
        root.join(path)
    } else {
        path.to_path_buf()
    };
    match joined.canonicalize() {
        Ok(resolved) if resolved == root => Err(refuse(format!(
            "path `{}` is the models directory itself; name a model inside it",
            path.display()
        ))),
        Ok(resolved) if resolved.starts_with(&root) => Ok(resolved),
        Ok(resolved) => {
            tracing::warn!(model, path = %path.display(), resolved = %resolved.display(),
                "refused a model path that resolves outside the models directory");
            Err(outside())
        }
        Err(e) if lexically_inside(&joined, &root) => {
            tracing::debug!(model, path = %joined.display(), "model path not usable: {e}");
            Err(refuse(format!(
                "path `{}` does not exist in the models directory (or cannot be read there)",
                path.display()
            )))
        }
        Err(e) => {
            tracing::warn!(model, path = %path.display(), "refused a model path: {e}");
            Err(outside())
        }
    }
}

/// Whether `path`, with `.` and `..` taken as written (no symlink
/// followed), lies inside `root`.
fn lexically_inside(path: &std::path::Path, root: &std::path::Path) -> bool {
    use std::path::Component;
    let mut normal = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                normal.pop();
            }
            Component::CurDir => {}
            other => normal.push(other),
        }
    }
    normal.starts_with(root) && normal != root
}
