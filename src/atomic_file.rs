//! Files written whole or not at all: every output file (models, checkpoints, predictions,
//! evaluation results) is written under a temporary name beside its destination and renamed
//! into place, so a kill or a full disk never leaves a complete-looking partial file.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

/// Where `path` is written before it is renamed into place: `.NAME.partial` beside it.
pub fn temporary_path(path: &Path) -> PathBuf {
    path.with_file_name(format!(
        ".{}.partial",
        path.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default()
    ))
}

/// Has `write` fill the temporary path, then renames it to `path`. A failed write removes the
/// temporary file and leaves any earlier `path` untouched.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary_path(path);
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    crate::fault::point(&format!("{} written", tmp.display()));
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))?;
    crate::fault::point(&format!("{} in place", path.display()));
    Ok(())
}

/// Writes bytes to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        std::fs::write(tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))
    })
}

/// Writes `value` as pretty JSON with a final newline, atomically.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .with_context(|| format!("cannot serialise {}", path.display()))?
        + "\n";
    write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_partial() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        write_json(&path, &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\n  \"a\": 1\n}\n"
        );
        let err = write_atomic_with(&path, |tmp| {
            std::fs::write(tmp, "half")?;
            anyhow::bail!("disk full")
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "disk full");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\n  \"a\": 1\n}\n"
        );
        assert!(!temporary_path(&path).exists());
    }
}
