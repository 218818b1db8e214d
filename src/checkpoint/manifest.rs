//! A checkpoint's manifest: its format version and, for every file in it, the size and a
//! CRC-32C of the contents. Written last into the checkpoint (after every other file is
//! synced), it says what a complete checkpoint holds, so a resume can tell an intact
//! checkpoint from one a power cut, a full disk or a stray `truncate` damaged.
//!
//! Formats: 1 had no manifest (its checkpoints load as before, unverified); 2 adds it.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::io::atomic_file::write_json;

pub const MANIFEST: &str = "manifest.json";

/// The checkpoint format this build writes; it reads this one and every earlier one.
pub const FORMAT: u32 = 2;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    pub files: Vec<FileEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub crc32c: u32,
}

/// What verifying a checkpoint found.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Every file the manifest lists is there with its size and checksum.
    Intact,
    /// Written before manifests existed (format 1): nothing to check against.
    Unverified,
    /// A file is missing, of the wrong size or with the wrong checksum: one line saying which.
    Damaged(String),
}

/// Size and CRC-32C of one file, read in 1 MiB pieces.
fn checksum(path: &Path) -> Result<(u64, u32)> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (mut bytes, mut crc) = (0u64, 0u32);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            return Ok((bytes, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        bytes += n as u64;
    }
}

/// Writes the manifest of every file now in `dir` (the checkpoint before it is published).
pub fn write(dir: &Path) -> Result<()> {
    let started = std::time::Instant::now();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().to_string()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("cannot list {}", dir.display()))?;
    names.retain(|n| n != MANIFEST && !n.starts_with('.'));
    names.sort();
    let files = names
        .into_iter()
        .map(|name| {
            let (bytes, crc32c) = checksum(&dir.join(&name))?;
            Ok(FileEntry {
                name,
                bytes,
                crc32c,
            })
        })
        .collect::<Result<_>>()?;
    let manifest = Manifest {
        format: FORMAT,
        files,
    };
    write_json(&dir.join(MANIFEST), &manifest)?;
    tracing::debug!(
        "{}: manifest of {} bytes in {:.2} s",
        dir.display(),
        manifest.files.iter().map(|f| f.bytes).sum::<u64>(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Checks checkpoint `dir` against its manifest. `format` is the one its trainer state
/// declares (1 where it declares none). A checkpoint of a newer format than this build reads
/// is an error, not damage: passing over it would train from an older one and overwrite it.
pub fn verify(dir: &Path, format: u32) -> Result<Verdict> {
    refuse_newer(dir, format)?;
    let path = dir.join(MANIFEST);
    if format < 2 && !path.exists() {
        return Ok(Verdict::Unverified);
    }
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => return Ok(Verdict::Damaged(format!("{}: {e}", path.display()))),
    };
    let manifest: Manifest = match serde_json::from_str(&text) {
        Ok(m) => m,
        Err(e) => return Ok(Verdict::Damaged(format!("{}: {e}", path.display()))),
    };
    refuse_newer(dir, manifest.format)?;
    let started = std::time::Instant::now();
    for entry in &manifest.files {
        let file = dir.join(&entry.name);
        let found = match checksum(&file) {
            Ok(found) => found,
            Err(_) if !file.exists() => {
                return Ok(Verdict::Damaged(format!("{} is missing", file.display())))
            }
            Err(e) => return Ok(Verdict::Damaged(format!("{e:#}"))),
        };
        if found.0 != entry.bytes {
            return Ok(Verdict::Damaged(format!(
                "{} has {} bytes, the manifest says {}",
                file.display(),
                found.0,
                entry.bytes
            )));
        }
        if found.1 != entry.crc32c {
            return Ok(Verdict::Damaged(format!(
                "{} does not match its checksum (CRC-32C {:08x}, the manifest says {:08x})",
                file.display(),
                found.1,
                entry.crc32c
            )));
        }
    }
    tracing::debug!(
        "{}: verified in {:.2} s",
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(Verdict::Intact)
}

fn refuse_newer(dir: &Path, format: u32) -> Result<()> {
    if format > FORMAT {
        bail!(
            "{} was written in checkpoint format {format} by a newer sprtrain; this one reads formats 1-{FORMAT}: upgrade sprtrain to resume from it",
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), vec![7u8; 3000]).unwrap();
        std::fs::write(dir.path().join("trainer_state.json"), "{}").unwrap();
        write(dir.path()).unwrap();
        dir
    }

    #[test]
    fn an_untouched_checkpoint_is_intact_and_lists_its_files() {
        let dir = checkpoint();
        assert_eq!(verify(dir.path(), FORMAT).unwrap(), Verdict::Intact);
        let m: Manifest =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(MANIFEST)).unwrap())
                .unwrap();
        let names: Vec<&str> = m.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["model.safetensors", "trainer_state.json"]);
        assert_eq!(m.files[0].bytes, 3000);
        // CRC-32C of "{}" (RFC 3720's polynomial), as crc32c computes it.
        assert_eq!(m.files[1].crc32c, crc32c::crc32c(b"{}"));
    }

    #[test]
    fn truncation_a_flipped_byte_and_a_missing_file_are_damage_naming_the_file() {
        let dir = checkpoint();
        let model = dir.path().join("model.safetensors");
        std::fs::write(&model, b"").unwrap();
        let Verdict::Damaged(why) = verify(dir.path(), FORMAT).unwrap() else {
            panic!("a truncated file is damage")
        };
        assert!(
            why.contains("model.safetensors has 0 bytes, the manifest says 3000"),
            "{why}"
        );
        let mut bytes = vec![7u8; 3000];
        bytes[1234] = 8;
        std::fs::write(&model, bytes).unwrap();
        let Verdict::Damaged(why) = verify(dir.path(), FORMAT).unwrap() else {
            panic!("a flipped byte is damage")
        };
        assert!(why.contains("does not match its checksum"), "{why}");
        std::fs::remove_file(&model).unwrap();
        let Verdict::Damaged(why) = verify(dir.path(), FORMAT).unwrap() else {
            panic!("a missing file is damage")
        };
        assert!(why.ends_with("model.safetensors is missing"), "{why}");
    }

    #[test]
    fn formats_without_a_manifest_newer_formats_and_a_lost_manifest() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(verify(dir.path(), 1).unwrap(), Verdict::Unverified);
        // Format 2 promises a manifest: without one the checkpoint is damaged.
        assert!(matches!(
            verify(dir.path(), 2).unwrap(),
            Verdict::Damaged(_)
        ));
        let err = verify(dir.path(), FORMAT + 1).unwrap_err().to_string();
        assert!(
            err.contains(&format!("checkpoint format {}", FORMAT + 1))
                && err.contains("upgrade sprtrain"),
            "{err}"
        );
    }
}
