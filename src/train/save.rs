//! The weights a save writes under ZeRO stage 3: no rank holds the whole model. Each bucket
//! of the flat buffer is gathered in turn (every rank keeps its own chunk of each) and rank 0
//! appends it to the model files as it arrives, in transformers' layout and sharding
//! (`checkpoint::streamed::StreamedModel`); the files then move into the checkpoint or the
//! output directory. LoRA's adapters, a few MB, and the best model loaded at the end are still
//! held whole (`LayerShards::hold_whole`).

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result};
use tch::Kind;

use super::Trainer;
use crate::checkpoint::streamed::StreamedModel;
use crate::checkpoint::{self, ModelFiles};

impl Trainer<'_> {
    /// The weights of a save (`tag`: its step, or `final`) where they stream: gathered into
    /// rank 0's files in `checkpoint::streamed_model_dir`, every rank taking part; rank 0 gets
    /// their names (or why it could not write them), the others None. Elsewhere the whole
    /// model is held on every rank (nothing to do below stage 3) and rank 0 writes it from its
    /// variables: None.
    pub(super) fn stream_weights(&mut self, tag: &str) -> Result<Option<Result<Vec<String>>>> {
        // ZeRO stage 3 training the whole model (LoRA's adapters are a few MB).
        if self.stage3().is_none() || self.model.config.lora.is_some() {
            self.hold_whole_model()?;
            return Ok(None);
        }
        self.opt.settle(); // lazily updated rows, up to this step
        let dir = checkpoint::streamed_model_dir(&self.out, tag);
        let mut writer = self.dist.is_root().then(|| self.weights_writer(&dir));
        let gathered = self
            .sync
            .gather_params_to_root(&self.opt.flat, self.dist, |values| match &mut writer {
                Some(Ok(w)) => w.append(values),
                _ => Ok(()),
            })?;
        Ok(writer.map(|w| {
            let mut w = w?;
            gathered?;
            for (_, var) in self.frozen_variables() {
                let values = var.to_kind(Kind::Float).reshape([-1]);
                w.append(&Vec::<f32>::try_from(&values)?)?;
            }
            w.finish()
        }))
    }

    /// A fresh `dir` and the writer of the model's weights into it: the flat buffer's
    /// parameters in buffer order (the order their buckets are gathered in), then the
    /// variables that do not train, by name.
    fn weights_writer(&self, dir: &Path) -> Result<StreamedModel> {
        if dir.exists() {
            std::fs::remove_dir_all(dir)
                .with_context(|| format!("cannot clear {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let usize_shape = |s: &[i64]| s.iter().map(|&d| d as usize).collect::<Vec<usize>>();
        let mut tensors: Vec<(String, Vec<usize>)> = (self.opt.flat.slots.iter())
            .map(|slot| (slot.name.clone(), usize_shape(&slot.shape)))
            .collect();
        for (name, var) in self.frozen_variables() {
            tensors.push((name, usize_shape(&var.size())));
        }
        StreamedModel::create(dir, &tensors, self.max_shard_bytes)
    }

    /// The model's variables outside the flat buffer (frozen ones), by name.
    fn frozen_variables(&self) -> Vec<(String, tch::Tensor)> {
        let trained: BTreeSet<&str> = self
            .opt
            .flat
            .slots
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        let mut frozen: Vec<(String, tch::Tensor)> = (self.vs.variables().into_iter())
            .filter(|(name, _)| !trained.contains(name.as_str()))
            .collect();
        frozen.sort_by(|a, b| a.0.cmp(&b.0));
        frozen
    }

    /// What a save writes besides the optimizer state; `written`: the weight files streamed
    /// already into `checkpoint::streamed_model_dir(.., tag)`.
    pub(super) fn files_with<'f>(
        &'f self,
        written: Option<(&'f Path, &'f [String])>,
    ) -> ModelFiles<'f> {
        ModelFiles {
            model: &self.model,
            vs: &self.vs,
            tokenizer: &self.tokenizer,
            resolved_config: &self.resolved_config,
            base_model: &self.config.model.name_or_path,
            max_shard_bytes: self.max_shard_bytes,
            written,
        }
    }

    /// Rank 0 writes the final model into the output directory: from its variables, or the
    /// files `weights` streamed.
    pub(super) fn save_final(&self, weights: Option<Result<Vec<String>>>) -> Result<()> {
        let dir = checkpoint::streamed_model_dir(&self.out, "final");
        let names = weights.transpose()?;
        let written = names.as_deref().map(|n| (dir.as_path(), n));
        let saved = checkpoint::save_final(&self.out, &self.files_with(written));
        if names.is_some() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        saved
    }
}
