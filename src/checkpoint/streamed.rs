//! A safetensors file of fp32 vectors written as their values arrive, in order: under ZeRO the
//! optimizer state is gathered a bucket at a time, and rank 0 writes each bucket as it comes
//! instead of first holding the whole state (twice its shard, and more, at 2 ranks).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::json;

/// An open file whose header names every tensor; values are appended tensor after tensor.
pub struct StreamedSafetensors {
    path: PathBuf,
    out: BufWriter<File>,
    /// Values still to come, over all tensors.
    left: usize,
}

impl StreamedSafetensors {
    /// Creates `path` with the header of fp32 vectors `tensors` (name, length), laid out in
    /// the order given, as safetensors' own writer would for these names and sizes.
    pub fn create(path: &Path, tensors: &[(String, usize)]) -> Result<StreamedSafetensors> {
        let mut header = BTreeMap::new();
        header.insert("__metadata__".to_string(), json!({"format": "pt"}));
        let mut at = 0usize;
        for (name, len) in tensors {
            let offsets = [at, at + 4 * len];
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": [len], "data_offsets": offsets}),
            );
            at += 4 * len;
        }
        let mut text = serde_json::to_string(&header)?.into_bytes();
        // The data starts 8-byte aligned, padded with spaces as safetensors pads.
        text.resize(text.len().next_multiple_of(8), b' ');
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        let written = out
            .write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&text));
        written.with_context(|| format!("cannot write {}", path.display()))?;
        Ok(StreamedSafetensors {
            path: path.to_path_buf(),
            out,
            left: at / 4,
        })
    }

    /// The next `values`, continuing where the last call stopped.
    pub fn append(&mut self, values: &[f32]) -> Result<()> {
        if values.len() > self.left {
            bail!(
                "{}: {} values more than the header announced",
                self.path.display(),
                values.len() - self.left
            );
        }
        // safetensors stores little-endian data, which f32 memory is on this target.
        const _: () = assert!(cfg!(target_endian = "little"));
        // SAFETY: any f32 slice is a valid byte slice of four times its length.
        let bytes = unsafe {
            std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
        };
        self.out
            .write_all(bytes)
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        self.left -= values.len();
        Ok(())
    }

    /// Checks every value arrived, then flushes and syncs the file to the disk.
    pub fn finish(self) -> Result<PathBuf> {
        if self.left > 0 {
            bail!("{}: {} values missing", self.path.display(), self.left);
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        file.sync_all()
            .with_context(|| format!("cannot sync {} to disk", self.path.display()))?;
        Ok(self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    /// What the safetensors library reads back: both tensors, values in order, and the
    /// metadata transformers' loaders look for.
    #[test]
    fn reads_back_as_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.safetensors");
        let names = [("exp_avg".to_string(), 5), ("exp_avg_sq".to_string(), 3)];
        let mut w = StreamedSafetensors::create(&path, &names).unwrap();
        for part in [&[1.0f32, 2.0][..], &[3.0, 4.0, 5.0], &[6.0], &[7.0, 8.0]] {
            w.append(part).unwrap();
        }
        assert!(w.append(&[9.0]).is_err(), "one value too many");
        w.finish().unwrap();
        let got = crate::models::weights::read_safetensors(&path).unwrap();
        let got: BTreeMap<String, Tensor> = got.into_iter().collect();
        let values = |n: &str| Vec::<f32>::try_from(&got[n]).unwrap();
        assert_eq!(values("exp_avg"), [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(values("exp_avg_sq"), [6.0, 7.0, 8.0]);
        let bytes = std::fs::read(&path).unwrap();
        let meta = safetensors::SafeTensors::read_metadata(&bytes).unwrap().1;
        assert_eq!(
            meta.metadata().as_ref().unwrap().get("format").unwrap(),
            "pt"
        );
    }

    #[test]
    fn a_short_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.safetensors");
        let mut w = StreamedSafetensors::create(&path, &[("m".to_string(), 4)]).unwrap();
        w.append(&[1.0, 2.0]).unwrap();
        let err = w.finish().unwrap_err().to_string();
        assert!(err.contains("2 values missing"), "{err}");
    }
}
