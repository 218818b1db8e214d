//! Safetensors files of fp32 tensors written as their values arrive, in order: under ZeRO the
//! optimizer state (and at stage 3 the weights) is gathered a bucket at a time, and rank 0
//! writes each bucket as it comes instead of first holding the whole state (twice its shard,
//! and more, at 2 ranks) or the whole model.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::json;

use super::{shard_ranges, weights_file_name, weights_index};
use crate::io::hf_files::INDEX_FILE;

/// An open file whose header names every tensor; values are appended tensor after tensor.
pub struct StreamedSafetensors {
    path: PathBuf,
    out: BufWriter<File>,
    /// Values still to come, over all tensors.
    left: usize,
}

impl StreamedSafetensors {
    /// Creates `path` with the header of fp32 tensors `tensors` (name, shape), laid out in
    /// the order given.
    pub fn create(path: &Path, tensors: &[(String, Vec<usize>)]) -> Result<StreamedSafetensors> {
        let mut header = BTreeMap::new();
        header.insert("__metadata__".to_string(), json!({"format": "pt"}));
        let mut at = 0usize;
        for (name, shape) in tensors {
            let len: usize = shape.iter().product();
            let offsets = [at, at + 4 * len];
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": shape, "data_offsets": offsets}),
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

/// Tensors by name and shape, in the order their values come.
type Tensors = Vec<(String, Vec<usize>)>;

/// A model's weights in transformers' layout written into a directory as their values arrive,
/// tensor after tensor in the order given: model.safetensors, or above `max_shard_bytes`
/// `model-0000K-of-0000N.safetensors` cut as `save_pretrained` cuts ([`shard_ranges`]) and
/// model.safetensors.index.json. ZeRO stage 3 gathers the weights a bucket at a time: no
/// process ever holds the whole model to save it.
pub struct StreamedModel {
    dir: PathBuf,
    /// The files still to open, each with its tensors.
    next: std::vec::IntoIter<(String, Tensors)>,
    open: Option<StreamedSafetensors>,
    index: Option<serde_json::Value>,
    /// The names of the files written, the index last.
    written: Vec<String>,
}

impl StreamedModel {
    /// Opens the first file in `dir` for fp32 `tensors` (name, shape), in the order their
    /// values will come.
    pub fn create(
        dir: &Path,
        tensors: &[(String, Vec<usize>)],
        max_shard_bytes: u64,
    ) -> Result<StreamedModel> {
        let bytes: Vec<u64> = tensors
            .iter()
            .map(|(_, shape)| 4 * shape.iter().product::<usize>() as u64)
            .collect();
        let shards = shard_ranges(&bytes, max_shard_bytes);
        let index = weights_index(tensors.iter().map(|(n, _)| n), &bytes, &shards);
        let files: Vec<_> = shards
            .iter()
            .enumerate()
            .map(|(k, r)| {
                (
                    weights_file_name(k, shards.len()),
                    tensors[r.clone()].to_vec(),
                )
            })
            .collect();
        let mut model = StreamedModel {
            dir: dir.to_path_buf(),
            next: files.into_iter(),
            open: None,
            index,
            written: Vec::new(),
        };
        model.open_next()?;
        Ok(model)
    }

    /// Finishes the open file, if any, and opens the next one, if any.
    fn open_next(&mut self) -> Result<()> {
        if let Some(file) = self.open.take() {
            file.finish()?;
        }
        if let Some((name, tensors)) = self.next.next() {
            self.open = Some(StreamedSafetensors::create(
                &self.dir.join(&name),
                &tensors,
            )?);
            self.written.push(name);
        }
        Ok(())
    }

    /// The next `values`, continuing where the last call stopped, across files.
    pub fn append(&mut self, mut values: &[f32]) -> Result<()> {
        while !values.is_empty() {
            let Some(file) = self.open.as_mut() else {
                bail!(
                    "{}: {} values more than the model has",
                    self.dir.display(),
                    values.len()
                );
            };
            let take = values.len().min(file.left);
            file.append(&values[..take])?;
            values = &values[take..];
            if file.left == 0 {
                self.open_next()?;
            }
        }
        Ok(())
    }

    /// Checks every value arrived, writes the index (if sharded), and returns the files'
    /// names in `dir`, each synced to the disk.
    pub fn finish(mut self) -> Result<Vec<String>> {
        if let Some(file) = self.open.take() {
            file.finish()?; // fails: values missing
        }
        if let Some(index) = &self.index {
            crate::io::atomic_file::write_json(&self.dir.join(INDEX_FILE), index)?;
            self.written.push(INDEX_FILE.to_string());
        }
        Ok(self.written)
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
        let names = [
            ("exp_avg".to_string(), vec![5]),
            ("exp_avg_sq".to_string(), vec![3]),
        ];
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
        let mut w = StreamedSafetensors::create(&path, &[("m".to_string(), vec![4])]).unwrap();
        w.append(&[1.0, 2.0]).unwrap();
        let err = w.finish().unwrap_err().to_string();
        assert!(err.contains("2 values missing"), "{err}");
    }

    /// A model streamed in shards reads back as the same tensors written whole, shapes and
    /// values, with the index naming each tensor's file; a value too many is refused.
    #[test]
    fn a_streamed_model_shards_as_save_pretrained_does() {
        let dir = tempfile::tempdir().unwrap();
        let tensors: Vec<(String, Vec<usize>)> = vec![
            ("b.weight".into(), vec![2, 3]),
            ("a.bias".into(), vec![4]),
            ("c.weight".into(), vec![3, 2]),
        ];
        // 24 + 16 + 24 bytes, at most 40 a shard: [b, a] and [c].
        let mut w = StreamedModel::create(dir.path(), &tensors, 40).unwrap();
        let values: Vec<f32> = (0..16).map(|v| v as f32).collect();
        for part in values.chunks(5) {
            w.append(part).unwrap();
        }
        assert!(w.append(&[0.0]).is_err(), "one value too many");
        let files = w.finish().unwrap();
        let first = "model-00001-of-00002.safetensors";
        let second = "model-00002-of-00002.safetensors";
        assert_eq!(files, [first, second, INDEX_FILE]);
        let read = |f: &str| -> BTreeMap<String, Tensor> {
            let t = crate::models::weights::read_safetensors(&dir.path().join(f)).unwrap();
            t.into_iter().collect()
        };
        let (a, b) = (read(first), read(second));
        assert_eq!(a["b.weight"].size(), [2, 3]);
        let got = |t: &Tensor| Vec::<f32>::try_from(&t.reshape([-1])).unwrap();
        assert_eq!(got(&a["b.weight"]), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(got(&a["a.bias"]), [6.0, 7.0, 8.0, 9.0]);
        assert_eq!(got(&b["c.weight"]), [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]);
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(index["weight_map"]["c.weight"], second);
        assert_eq!(index["metadata"]["total_size"], 64);
    }
}
