//! Files written whole or not at all, and kept once published: every output file (models,
//! checkpoints, predictions, evaluation results, the plot) is written under a temporary name
//! beside its destination, synced to disk, renamed into place, and its directory synced after
//! the rename. A kill or a full disk never leaves a complete-looking partial file, and a power
//! cut after the rename never brings the name back with empty or partial contents (the order
//! PostgreSQL and SQLite use: fsync the file, rename, fsync the directory).

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

/// Has `write` fill the temporary path, syncs it, then publishes it as `path` (see
/// [`publish`]). A failed write removes the temporary file and leaves any earlier `path`
/// untouched.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary_path(path);
    if let Err(e) = write(&tmp).and_then(|()| sync_file(&tmp)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    crate::runtime::fault::point(&format!("{} written", tmp.display()));
    publish(&tmp, path)?;
    crate::runtime::fault::point(&format!("{} in place", path.display()));
    Ok(())
}

/// Renames a synced file or directory `from` to `to` and syncs the directory holding `to`, so
/// the new name survives a power cut. A directory must have been synced itself
/// ([`sync_dir`]) with everything in it.
pub fn publish(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to)
        .with_context(|| format!("cannot move {} to {}", from.display(), to.display()))?;
    sync_dir(parent(to))
}

/// Flushes a written file's data and metadata to the disk.
pub fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {} to disk", path.display()))
}

/// Flushes a directory's entries (names created, renamed or removed in it) to the disk.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync directory {} to disk", dir.display()))
}

/// The directory holding `path` (`.` for a bare file name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
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
