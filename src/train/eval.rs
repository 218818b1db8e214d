//! Evaluation, during training and of a saved model (`sprtrain eval`): each process runs the
//! model over a contiguous shard of the evaluation features, the outputs are gathered in
//! order, and the task turns them into metrics, so results equal one process's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::dataset::resolve_data;
use super::layer_shards::LayerShards;
use super::setup::{on_every_rank, prepare, set_up_numerics, ModelSource};
use crate::config::Config;
use crate::data::batching::{batch_labels, collate, Feature};
use crate::dist::Dist;
use crate::io::atomic_file::write_json;
use crate::io::hf_files::CONFIG_FILE;
use crate::models::{lora, LayerParams, TaskModel};
use crate::optim::FlatParams;
use crate::tasks::{self, EvalSet};

/// Where evaluation results go in an output directory.
pub const EVAL_RESULTS: &str = "eval_results.json";

/// How evaluation batches are made and where predictions go.
pub struct EvalOptions<'a> {
    pub batch_size: usize,
    pub pad_to: Option<usize>,
    /// Where rank 0 writes the task's prediction files (question answering's
    /// predictions.json and nbest_predictions.json).
    pub predictions_dir: Option<&'a Path>,
}

impl<'a> EvalOptions<'a> {
    pub fn new(config: &Config, predictions_dir: Option<&'a Path>) -> Self {
        EvalOptions {
            batch_size: config.eval.batch_size,
            pad_to: config.pad_to(),
            predictions_dir,
        }
    }
}

/// Evaluates on `set`: mean loss and the task's metrics, keys prefixed `eval_`, the same on
/// every process. Under ZeRO stage 3 (`stage3`) each layer's weights are gathered as the
/// layer runs, as in a training pass, and a rank with a batch fewer than another takes part
/// in its gathers; afterwards each rank holds only its own chunks again.
pub fn evaluate(
    model: &TaskModel,
    set: &dyn EvalSet,
    opts: &EvalOptions,
    dist: &Dist,
    stage3: Option<(&LayerShards, &FlatParams)>,
) -> Result<BTreeMap<String, f64>> {
    let features = set.features();
    let (rank, world) = (dist.topo.rank, dist.topo.world);
    let bounds = |r: usize| features.len() * r / world..features.len() * (r + 1) / world;
    let shard = &features[bounds(rank)];
    if let Some((layers, flat)) = stage3 {
        layers.begin_step(flat, dist)?;
    }
    let pass = stage3.map(|(layers, flat)| layers.for_pass(flat, dist));
    let params = pass.as_ref().map(|p| p as &dyn LayerParams);
    // Features of like length pad little: batches are formed longest first (as `predict`
    // does), and each feature's outputs go back to its place in the shard.
    let started = std::time::Instant::now();
    let mut order: Vec<usize> = (0..shard.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(shard[i].input_ids.len()));
    let mut per_feature: Vec<Vec<f32>> = vec![Vec::new(); shard.len()];
    let mut loss_sum = 0.0;
    for indices in order.chunks(opts.batch_size) {
        let batch: Vec<&Feature> = indices.iter().map(|&i| shard[i]).collect();
        let (inputs, _) = collate(&batch, model.config.pad_token_id, opts.pad_to);
        let out = tch::no_grad(|| match params {
            Some(p) => model.forward_sharded(&inputs, false, false, Some(p)).0,
            None => model.forward(&inputs, false),
        });
        let labels = batch_labels(&batch, inputs.input_ids.size()[1] as usize)?;
        loss_sum += model.loss(&out, &labels)?.double_value(&[]) * batch.len() as f64;
        for (row, (&i, feature)) in indices.iter().zip(&batch).enumerate() {
            per_feature[i] = set.batch_outputs(&out.row(row as i64), &[feature])?;
        }
    }
    if let Some((layers, flat)) = stage3 {
        layers.take_error()?;
        let batches = |r: usize| bounds(r).len().div_ceil(opts.batch_size.max(1));
        let most = (0..world).map(batches).max().unwrap_or(0);
        for _ in batches(rank)..most {
            layers.idle_forward(flat, dist)?;
        }
        layers.end_step(flat, dist)?;
    }
    let outputs: Vec<f32> = per_feature.concat();
    let seconds = started.elapsed().as_secs_f64();
    if dist.is_root() {
        tracing::info!(
            "evaluated {} features in {seconds:.2} s ({:.1} features/s on rank 0)",
            shard.len(),
            shard.len() as f64 / seconds.max(1e-9)
        );
    }
    let outputs: Vec<f32> = dist.all_gather_f32("evaluation outputs", outputs)?.concat();
    let loss_sum = dist.allreduce_sum_f64("evaluation loss", vec![loss_sum])?[0];
    let predictions_dir = opts.predictions_dir.filter(|_| dist.is_root());
    let mut m = set.metrics(&outputs, predictions_dir)?;
    // The mean of the examples' losses, unless the task weighs them itself (per token).
    m.entry("loss".into())
        .or_insert(loss_sum / features.len().max(1) as f64);
    Ok(m.into_iter()
        .map(|(k, v)| (format!("eval_{k}"), v))
        .collect())
}

/// Writes `eval_results.json` into `dir` (atomically).
pub fn write_eval_results(dir: &Path, metrics: &BTreeMap<String, f64>) -> Result<()> {
    write_json(&dir.join(EVAL_RESULTS), metrics)
}

/// `sprtrain eval`: evaluates the model in `model_dir` (default: the final model in
/// `train.output_dir`) on the config's evaluation data, as training's final evaluation does,
/// and writes eval_results.json and the task's predictions into `output_dir` (default
/// `train.output_dir`). Returns the metrics on rank 0, None elsewhere.
pub fn evaluate_saved(
    config: &Config,
    model_dir: Option<&Path>,
    output_dir: Option<&Path>,
) -> Result<Option<BTreeMap<String, f64>>> {
    on_every_rank(&config.dist, |dist| {
        let root = dist.is_root();
        let default_dir = PathBuf::from(&config.train.output_dir);
        let dir = model_dir.unwrap_or(&default_dir);
        // A LoRA run saves adapters only; they load onto the config's base model.
        if !dir.join(CONFIG_FILE).is_file() && !lora::is_adapter_dir(dir) {
            bail!(
                "no model in {} (no {CONFIG_FILE}): train first, or pass --model DIR",
                dir.display()
            );
        }
        let data = tasks::read(config, &resolve_data(config, root)?, root)?;
        if !data.has_eval() {
            bail!("no evaluation data: set data.eval_file, or data.eval_split to hold out part of data.train_file");
        }
        let _autocast = set_up_numerics(config, dist)?;
        let source = ModelSource {
            dir,
            fresh: false,
            random: false,
        };
        let p = prepare(config, dist, data, source, true)?;
        let set = p.eval.context("no evaluation data")?;
        let out = output_dir.unwrap_or(&default_dir);
        if root {
            std::fs::create_dir_all(out)
                .with_context(|| format!("cannot create {}", out.display()))?;
        }
        let m = evaluate(
            &p.model,
            set.as_ref(),
            &EvalOptions::new(config, Some(out)),
            dist,
            None,
        )?;
        if root {
            write_eval_results(out, &m)?;
        }
        Ok(root.then_some(m))
    })
}
