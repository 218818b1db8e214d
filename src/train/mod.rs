//! Fine-tuning: `sprtrain --config X.toml`. [`Trainer::run`] is the loop, read top to bottom;
//! [`Trainer::step`] is one optimizer step.
//!
//! Each optimizer step consumes one global batch (see `data::batching`): each process runs
//! forward and backward on its micro-batches, gradients are gathered into the flat buffer and
//! summed across processes bucket by bucket (`grad_sync`), then clipped and applied by AdamW —
//! identically on every process. Dropout is reseeded from (seed, step, micro-batch) so a
//! resumed run, or a run on another number of processes, draws the same masks. Rank 0 alone
//! writes files and the progress bar; an error on any rank stops them all.
//!
//! The loop never asks which task it trains: the task (`crate::tasks`) reads and tokenizes the
//! data, the features' targets make the labels, and the model's head computes the loss.

mod dataset;
pub mod eval;
mod grad_sync;
mod layer_shards;
pub mod memory;
pub mod profile;
mod save;
pub mod setup;
mod window;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::checkpoint::{self, OptimizerState, TokenizerFiles, TrainerState};
use crate::config::{Config, EvalStrategy, OnSaveError, TrainConfig};
use crate::data::batching::{batch_labels, collate, BatchPlan, Feature};
use crate::data::masking::Masking;
use crate::dist::Dist;
use crate::models::layers::{seed_dropout, AutocastGuard};
use crate::models::{backward_by_stages, LayerParams, TaskModel};
use crate::optim::{AdamW, AdamWConfig, FlatParams, LrSchedule, Optimizer};
use crate::report::tensorboard::EventWriter;
use crate::report::{MetricsLog, Progress};
use crate::runtime::signals::{self, Interrupted};
use crate::runtime::startup;
use crate::tasks::{self, EvalSet};
use dataset::resolve_data;
use eval::{evaluate, write_eval_results, EvalOptions};
use grad_sync::{agree_and_broadcast, GradSync};
use layer_shards::LayerShards;
use profile::StepProfiler;
use setup::{on_every_rank, prepare, prepare_output_dir, resolve_model, set_up_numerics};
use window::{StepOutcome, StepTimes, StepWindow};

pub use eval::evaluate_saved;
pub use setup::ModelSource;

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Whether this process is rank 0, the one that reports.
    pub root: bool,
    pub output_dir: PathBuf,
    pub steps: usize,
    pub epochs_done: f64,
    pub train_loss: f64,
    pub wall_s: f64,
    pub samples_per_s: f64,
    pub eval: BTreeMap<String, f64>,
}

/// Runs the fine-tuning described by `config`; `resume` is `latest` or a checkpoint path.
/// Under an MPI launcher this process is one rank of the job; an error on any rank is printed
/// with its rank and stops every rank.
pub fn train(config: &Config, resume: Option<&str>) -> Result<Summary> {
    on_every_rank(&config.dist, |dist| {
        Trainer::new(config, resume, dist)?.run()
    })
}

/// The optimizer training uses: AdamW with `tc`'s hyperparameters over `flat`, the learning
/// rate schedule over `total_steps`, and clipping.
pub fn optimizer(tc: &TrainConfig, flat: FlatParams, total_steps: usize) -> Result<Optimizer> {
    let total = total_steps as i64;
    let warmup = LrSchedule::warmup_from(tc.warmup_steps as i64, tc.warmup_ratio, total);
    let schedule = LrSchedule {
        min_lr_rate: tc.min_lr_rate,
        ..LrSchedule::new(tc.lr_scheduler, tc.learning_rate, warmup, total)?
    };
    let adam = AdamWConfig {
        beta1: tc.adam_beta1,
        beta2: tc.adam_beta2,
        eps: tc.adam_epsilon,
        weight_decay: tc.weight_decay,
    };
    Ok(Optimizer {
        adamw: AdamW::new(adam, &flat),
        flat,
        schedule,
        max_grad_norm: tc.max_grad_norm,
    })
}

/// How `examples` become global batches: the plan, steps per epoch and total steps.
fn batch_plan(config: &Config, world: usize, examples: usize) -> Result<(BatchPlan, usize, usize)> {
    let tc = &config.train;
    let plan = BatchPlan {
        micro_batch: tc.batch_size,
        accumulation: tc.gradient_accumulation_steps,
        world,
        seed: config.runtime.seed,
        drop_last: tc.drop_last,
        group_by_length: config.data.group_by_length,
    };
    let steps_per_epoch = plan.steps_per_epoch(examples);
    if steps_per_epoch == 0 {
        bail!(
            "{examples} training examples make no full global batch of {} (train.drop_last is set)",
            plan.global_batch()
        );
    }
    let total_steps = match tc.max_steps {
        0 => tc.epochs * steps_per_epoch,
        n => n,
    };
    Ok((plan, steps_per_epoch, total_steps))
}

/// Where a resumed run continues in the saved run's data. The order of examples depends on
/// the seed and the epoch alone, so at the same global batch the run continues exactly, at any
/// number of processes (batch size x accumulation x processes may be factored anew). A changed
/// global batch is refused unless allowed; then the run continues with the first global batch
/// that starts after the examples of the epoch already seen.
fn continue_data_position(state: &mut TrainerState, plan: &BatchPlan, allow: bool) -> Result<()> {
    let (saved, now) = (state.global_batch, plan.global_batch());
    if saved == 0 || saved == now {
        return Ok(());
    }
    let this_run = format!(
        "train.batch_size {} x train.gradient_accumulation_steps {} x {} process(es)",
        plan.micro_batch, plan.accumulation, plan.world
    );
    if !allow {
        bail!(
            "the checkpoint was trained with a global batch of {saved} examples per step ({} process(es)); this run's is {now} ({this_run}): choose batch size and accumulation so that the product is {saved} to continue exactly, or set train.allow_global_batch_change = true",
            state.world_size
        );
    }
    let seen = state.batch_in_epoch * saved;
    state.batch_in_epoch = seen.div_ceil(now);
    tracing::warn!(
        "the global batch changes from {saved} to {now} examples per step ({this_run}); continuing after the {seen} examples of epoch {} already seen",
        state.epoch
    );
    Ok(())
}

/// The f64 values every step sums over the processes besides the gradient: the loss, the
/// real tokens, a flag for each stop signal (SIGTERM, SIGINT), and under ZeRO the gradient's
/// sum of squares over each rank's shard (0 otherwise).
pub const STEP_TOTALS: usize = 5;

/// The dropout stream's seed for one micro-batch: the same on every rank for the same
/// micro-batch of the global batch. Part of the training order that tests/golden.rs pins.
pub fn dropout_seed(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(1_000_003)
        .wrapping_add(step as u64 * 4096 + micro as u64)
}

/// A training run on this process.
pub struct Trainer<'a> {
    config: &'a Config,
    dist: &'a Dist,
    started: Instant,
    out: PathBuf,
    /// bf16 compute while the run lives, where configured.
    _autocast: AutocastGuard,
    vs: tch::nn::VarStore,
    model: TaskModel,
    tokenizer: TokenizerFiles,
    /// The resolved config, saved with every checkpoint.
    resolved_config: String,
    /// `train.save_max_shard_size` in bytes.
    max_shard_bytes: u64,
    train: Vec<Feature>,
    /// Token count of each training feature, for length grouping.
    lengths: Vec<usize>,
    eval: Option<Box<dyn EvalSet>>,
    /// Masked LM: masks drawn for each micro-batch from the step and example indices.
    masking: Option<Masking>,
    plan: BatchPlan,
    steps_per_epoch: usize,
    total_steps: usize,
    opt: Optimizer,
    sync: GradSync,
    /// Under ZeRO, the layers' weights gathered as the passes reach them (stage 3: and
    /// dropped after use).
    layers: Option<LayerShards>,
    state: TrainerState,
    log: Option<MetricsLog>,
    /// TensorBoard event file (rank 0, `train.report_to`).
    tensorboard: Option<EventWriter>,
    progress: Progress,
    /// Since the last log record, and since the start of this process's run.
    window: StepWindow,
    run_totals: StepWindow,
    /// The last evaluation's metrics (with the epoch), reported at the end.
    final_eval: BTreeMap<String, f64>,
    /// Early stopping asked to end training.
    stop: bool,
    /// A stop signal ended training: the run saves, then ends with it.
    interrupted: Option<i32>,
    /// The newest checkpoint this run saved (rank 0).
    last_checkpoint: Option<PathBuf>,
    /// libtorch's operator profile over `runtime.profile_steps` steps (rank 0).
    profiler: Option<StepProfiler>,
}

impl<'a> Trainer<'a> {
    /// Sets up a run: output directory, numerics, data, model, batch plan, optimizer (restored
    /// when resuming), and agreement between processes on all of it.
    pub fn new(config: &'a Config, resume: Option<&str>, dist: &'a Dist) -> Result<Self> {
        let started = Instant::now();
        startup::mark("mpi_init");
        if config.train.save_on_signal {
            // From now on a signal waits for the first step boundary (the data and model may
            // take a while to load).
            signals::install()?;
        }
        let root = dist.is_root();
        let out = PathBuf::from(&config.train.output_dir);
        let resume_dir = output_and_resume_dirs(config, &out, resume, root)?;
        let autocast = set_up_numerics(config, dist)?;
        startup::mark("threads");
        // The data (its labels can size the head), and the pretrained model with a head for
        // this task, or the checkpoint to resume.
        let (model_dir, random) = resolve_model(config, root)?;
        if let Some(dir) = &resume_dir {
            setup::check_resumed_model(config, &model_dir, dir)?;
        }
        let data = tasks::read(config, &resolve_data(config, root)?, root)?;
        startup::mark("read_data");
        let source = ModelSource {
            dir: resume_dir.as_deref().unwrap_or(&model_dir),
            fresh: resume_dir.is_none(),
            random,
        };
        let mut p = prepare(config, dist, data, source, false)?;
        // Checkpointing trades compute for memory: so does a causal LM loss made a chunk of
        // logits at a time (their (B, T, V) tensors are most of what checkpointing leaves).
        p.model.chunked_lm_loss = config.train.gradient_checkpointing;
        let (plan, steps_per_epoch, total_steps) =
            batch_plan(config, dist.topo.world, p.train.len())?;
        let (mut opt, sync) = training_state(config, dist, &mut p, total_steps)?;
        let layers = sync.layer_shards(p.model.config.num_layers as usize);
        startup::mark("optimizer");
        let mut state = start_state(config, resume_dir.as_deref(), &mut opt, &plan, total_steps)?;
        state.world_size = dist.topo.world;
        let (log, tensorboard, profiler) = if root {
            run_outputs(config, &out, resume_dir.is_some())?
        } else {
            (None, None, None)
        };
        Ok(Trainer {
            config,
            dist,
            started,
            _autocast: autocast,
            resolved_config: config.to_toml()?,
            max_shard_bytes: config.train.max_shard_bytes()?,
            lengths: p.train.iter().map(|f| f.input_ids.len()).collect(),
            progress: Progress::new(total_steps, state.global_step, root),
            out,
            vs: p.vs,
            model: p.model,
            tokenizer: TokenizerFiles::read(&p.tokenizer_json)?,
            train: p.train,
            eval: p.eval,
            masking: p.masking,
            plan,
            steps_per_epoch,
            total_steps,
            opt,
            sync,
            layers,
            state,
            log,
            tensorboard,
            window: StepWindow::default(),
            run_totals: StepWindow::default(),
            final_eval: BTreeMap::new(),
            stop: false,
            interrupted: None,
            last_checkpoint: None,
            profiler,
        })
    }

    /// Trains to the planned number of steps, evaluating, logging and saving on the way;
    /// then saves the final model.
    pub fn run(mut self) -> Result<Summary> {
        self.announce_start()?;
        while self.state.global_step < self.total_steps && !self.stop {
            let batches = self.plan.epoch(&self.lengths, self.state.epoch);
            let mut epoch_done = false;
            for (index, global) in batches.iter().enumerate().skip(self.state.batch_in_epoch) {
                if let Some(profiler) = &mut self.profiler {
                    profiler.before_step(self.state.global_step as u64 + 1)?;
                }
                let outcome = self.step(global)?;
                epoch_done = self.advance(index, batches.len());
                let last = self.state.global_step == self.total_steps;
                if let Some(profiler) = &mut self.profiler {
                    let step = self.state.global_step as u64;
                    if let Some(table) = profiler.after_step(step, last || self.stop)? {
                        tracing::info!("operator profile: {}", table.display());
                    }
                }
                let epoch = self.state.epoch as f64
                    + self.state.batch_in_epoch as f64 / batches.len() as f64;
                if outcome.signal.is_some() {
                    (self.interrupted, self.stop) = (outcome.signal, true);
                }
                self.after_step(&outcome, epoch, epoch_done, last)?;
                if let Some(signal) = self.interrupted {
                    return Err(self.interruption(signal));
                }
                if last || epoch_done || self.stop {
                    break;
                }
            }
            if !epoch_done && self.state.global_step < self.total_steps && !self.stop {
                // Only reachable when resuming exactly at an epoch's end.
                self.state.epoch += 1;
                self.state.batch_in_epoch = 0;
            }
        }
        self.finish()
    }

    /// One optimizer step on global batch `global`: forward and backward of this process's
    /// micro-batches, the gradient summed over all processes, then clipping and AdamW.
    pub fn step(&mut self, global: &[usize]) -> Result<StepOutcome> {
        let distributed = self.dist.topo.world > 1;
        let sent_before = self.dist.bytes_sent();
        let mut times = StepTimes::default();
        let (loss_sum, tokens) = self.forward_backward(global, &mut times)?;
        let t = Instant::now();
        if distributed && !self.sync.reduces_every_micro_batch() {
            self.sync.finish(&self.opt, self.dist)?;
        }
        let sharded = self.sync.zero_stage() > 0;
        // Under ZeRO each rank holds its shard of the summed gradient: the ranks add up the
        // squares of the global norm with the step's totals.
        let square_sum = match sharded {
            true => self.opt.adamw.shard_grad_square_sum(&self.opt.flat),
            false => 0.0,
        };
        // A stop signal on any process reaches all of them with the step's sums.
        let signal = signals::received();
        let flag = |s: i32| f64::from(u8::from(signal == Some(s)));
        let totals: [f64; STEP_TOTALS] = [
            loss_sum,
            tokens as f64,
            flag(libc::SIGTERM),
            flag(libc::SIGINT),
            square_sum,
        ];
        let totals = self.dist.allreduce_sum_f64("step loss", totals.to_vec())?;
        times.comm_exposed += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let update = match sharded {
            true => self
                .opt
                .step_with_norm(self.state.global_step, totals[4].sqrt()),
            false => self.opt.step(self.state.global_step),
        };
        self.opt.adamw.release_shard_grads();
        times.optimizer += t.elapsed().as_secs_f64();
        let t = Instant::now();
        if let Some(layers) = &self.layers {
            layers.refresh(&self.opt.flat, self.dist)?; // waited for by the next passes
        }
        times.comm_exposed += t.elapsed().as_secs_f64();
        if !totals[0].is_finite() {
            bail!(
                "loss became {} at step {}",
                totals[0],
                self.state.global_step + 1
            );
        }
        Ok(StepOutcome {
            loss: totals[0],
            samples: global.len(),
            tokens: totals[1] as usize,
            update,
            times,
            bytes_sent: self.dist.bytes_sent() - sent_before,
            signal: if totals[2] > 0.0 {
                Some(libc::SIGTERM)
            } else if totals[3] > 0.0 {
                Some(libc::SIGINT)
            } else {
                None
            },
        })
    }

    /// Forward and backward of this process's micro-batches of `global`, their gradients
    /// summed over the processes as backward completes them (the last micro-batch's, or at
    /// ZeRO stage 2 each one's); the summed loss and real tokens.
    fn forward_backward(
        &mut self,
        global: &[usize],
        times: &mut StepTimes,
    ) -> Result<(f64, usize)> {
        let micro = self.plan.micro_batches(global, self.dist.topo.rank);
        // Each micro-batch's mean loss counts 1/(micro-batches in the whole step): the
        // gradient is their mean whatever the number of processes, tails included.
        let micro_in_step = global.len().div_ceil(self.plan.micro_batch) as f64;
        let distributed = self.dist.topo.world > 1;
        let (mut loss_sum, mut tokens) = (0.0, 0usize);
        let step = self.state.global_step + 1;
        self.sync.begin(step);
        if let Some(layers) = &self.layers {
            layers.begin_step(&self.opt.flat, self.dist)?;
        }
        // ZeRO stage 2 reduces every micro-batch, so every rank takes part in as many rounds
        // as rank 0 has micro-batches (the first ranks have the most), with zeros where it
        // has none left.
        let every = distributed && self.sync.reduces_every_micro_batch();
        let rounds = match every {
            true => self.plan.micro_batches(global, 0).len(),
            false => micro.len(),
        };
        for m in 0..rounds {
            if let Some(indices) = micro.get(m) {
                // The last micro-batch of a step, with several processes, runs backward stage
                // by stage so each gradient bucket leaves as soon as it is complete.
                let staged = distributed && (every || m + 1 == micro.len());
                let (loss, real_tokens) =
                    self.micro_step(m, indices, micro_in_step, staged, times)?;
                loss_sum += loss;
                tokens += real_tokens;
            } else if let Some(layers) = &self.layers {
                layers.idle_pass(&self.opt.flat, self.dist)?;
            }
            if every {
                let t = Instant::now();
                self.sync.finish(&self.opt, self.dist)?;
                self.sync.begin(step);
                times.comm_exposed += t.elapsed().as_secs_f64();
            }
        }
        if let Some(layers) = &self.layers {
            layers.end_step(&self.opt.flat, self.dist)?;
        }
        Ok((loss_sum, tokens))
    }

    /// Forward and backward of micro-batch `m` of this process's share of the step; its loss
    /// (already divided by the step's micro-batch count) and its real tokens.
    fn micro_step(
        &mut self,
        m: usize,
        indices: &[usize],
        micro_in_step: f64,
        staged: bool,
        times: &mut StepTimes,
    ) -> Result<(f64, usize)> {
        let t = Instant::now();
        let masked: Vec<Feature>;
        let batch: Vec<&Feature> = match &self.masking {
            Some(masking) => {
                let step = self.state.global_step as u64;
                masked = indices
                    .iter()
                    .map(|&i| masking.mask(&self.train[i], step, i))
                    .collect();
                masked.iter().collect()
            }
            None => indices.iter().map(|&i| &self.train[i]).collect(),
        };
        let pad_id = self.model.config.pad_token_id;
        let (inputs, real_tokens) = collate(&batch, pad_id, self.config.pad_to());
        let labels = batch_labels(&batch, inputs.input_ids.size()[1] as usize)?;
        times.data += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let micro_index = self.dist.topo.rank * self.plan.accumulation + m;
        let seed = self.config.runtime.seed;
        seed_dropout(dropout_seed(seed, self.state.global_step, micro_index));
        self.opt.catch_up(&inputs.input_ids)?;
        // Activation checkpointing needs the pass cut into stages, to recompute them.
        let checkpoint = self.config.train.gradient_checkpointing;
        // ZeRO stage 3: each layer's weights gathered as it comes (all its passes are staged).
        let pass = self
            .layers
            .as_ref()
            .map(|l| l.for_pass(&self.opt.flat, self.dist));
        let params = pass.as_ref().map(|p| p as &dyn LayerParams);
        let (output, stages) = match staged || checkpoint {
            true => {
                let (output, stages) = self
                    .model
                    .forward_sharded(&inputs, true, checkpoint, params);
                (output, Some(stages))
            }
            false => {
                self.hold_whole_model()?; // the layers wait for nothing in a plain pass
                (self.model.forward(&inputs, true), None)
            }
        };
        let loss = self.model.loss(&output, &labels)? / micro_in_step;
        times.forward += t.elapsed().as_secs_f64();
        let t = Instant::now();
        match (&stages, staged) {
            (Some(stages), true) => self
                .sync
                .backward_staged(&loss, stages, &self.opt, self.dist)?,
            (Some(stages), false) => backward_by_stages(&loss, stages, |_| Ok(()))?,
            (None, _) => loss.backward(),
        }
        if let Some(layers) = &self.layers {
            layers.take_error()?;
        }
        times.backward += t.elapsed().as_secs_f64();
        Ok((loss.double_value(&[]), real_tokens))
    }

    /// Moves the state past global batch `index` of `batches`; true when the epoch ended.
    fn advance(&mut self, index: usize, batches: usize) -> bool {
        let s = &mut self.state;
        s.global_step += 1;
        s.optimizer_step = self.opt.adamw.step;
        s.batch_in_epoch = index + 1;
        if s.batch_in_epoch < batches {
            return false;
        }
        s.epoch += 1;
        s.batch_in_epoch = 0;
        true
    }

    /// Logging, evaluation and checkpoints due after a step.
    fn after_step(
        &mut self,
        outcome: &StepOutcome,
        epoch: f64,
        epoch_done: bool,
        last: bool,
    ) -> Result<()> {
        let (tc, step) = (&self.config.train, self.state.global_step);
        self.window.add(outcome);
        self.run_totals.add(outcome);
        self.progress.step(outcome.loss, outcome.samples);
        if step % tc.logging_steps.max(1) == 0 || last {
            let record = self.window.take_record(step, epoch, outcome.update);
            self.record(record)?;
        }
        let eval_now = match self.config.eval.strategy {
            EvalStrategy::Steps => step % self.config.eval.steps.max(1) == 0,
            EvalStrategy::Epoch => epoch_done,
            EvalStrategy::No => false,
        };
        let evaluated = (eval_now || last) && self.evaluate(epoch)?;
        let save_now = (tc.save_steps > 0 && step % tc.save_steps == 0)
            || last
            || self.stop
            || (evaluated && tc.load_best_model_at_end);
        if save_now {
            let weights = self.stream_weights(&step.to_string())?;
            // Every rank's share of the optimizer state, gathered on rank 0, which saves.
            if let Some(optimizer) = self.optimizer_state()? {
                self.save_checkpoint(optimizer, weights)?;
            }
        }
        Ok(())
    }

    /// The layer shards of a ZeRO stage-3 run, which never holds the whole model.
    fn stage3(&self) -> Option<&LayerShards> {
        self.layers.as_ref().filter(|l| !l.keeps_whole())
    }

    /// Under ZeRO, the whole model on every rank: at stages 1-2 the step's gathers waited for,
    /// before anything but a training pass reads the weights; at stage 3 gathered, for a save
    /// that writes it from the variables (LoRA's, or the best model's at the end; the next
    /// step drops it).
    fn hold_whole_model(&self) -> Result<()> {
        match &self.layers {
            Some(layers) => layers.hold_whole(&self.opt.flat, self.dist),
            None => Ok(()),
        }
    }

    /// The AdamW moments over the whole model, as checkpoints save them, on rank 0 (None on
    /// the others): under ZeRO gathered from every rank's shard a bucket at a time and written
    /// to a file as they arrive (or why rank 0 could not write it).
    fn optimizer_state(&mut self) -> Result<Option<Result<OptimizerState>>> {
        self.opt.settle(); // lazily updated rows, up to this step
        let moments = self.opt.adamw.moments();
        if self.sync.zero_stage() > 0 {
            let path = checkpoint::streamed_optimizer_path(&self.out, self.state.global_step);
            let written = self.sync.write_moments(&moments, self.dist, &path)?;
            return Ok(written.map(|w| w.map(OptimizerState::Written)));
        }
        let moments = OptimizerState::Moments(moments.into_iter().collect());
        Ok(self.dist.is_root().then_some(Ok(moments)))
    }

    /// Rank 0 saves a checkpoint of this step. A failed save has left every earlier checkpoint
    /// as it was; it ends the run or, with `train.on_save_error = "continue"`, is reported
    /// (log, metrics.jsonl) and training goes on.
    fn save_checkpoint(
        &mut self,
        optimizer: Result<OptimizerState>,
        weights: Option<Result<Vec<String>>>,
    ) -> Result<()> {
        let (tc, step) = (&self.config.train, self.state.global_step);
        let started = Instant::now();
        let streamed = matches!(optimizer, Ok(OptimizerState::Written(_)) | Err(_));
        let weights_dir = checkpoint::streamed_model_dir(&self.out, &step.to_string());
        let streamed_weights = weights.is_some();
        let saved = weights.transpose().and_then(|names| {
            let written = names.as_deref().map(|n| (weights_dir.as_path(), n));
            checkpoint::save_checkpoint(
                &self.out,
                &self.files_with(written),
                &self.state,
                &optimizer?,
                tc.save_total_limit,
            )
        });
        if streamed {
            // Moved into the checkpoint, or left by a failed save: not kept either way.
            let _ = std::fs::remove_file(checkpoint::streamed_optimizer_path(&self.out, step));
        }
        if streamed_weights {
            let _ = std::fs::remove_dir_all(&weights_dir);
        }
        match saved {
            Ok(dir) => {
                self.sync_logs()?;
                let seconds = started.elapsed().as_secs_f64();
                self.progress
                    .note(&format!("saved {} in {seconds:.2} s", dir.display()));
                self.last_checkpoint = Some(dir);
            }
            Err(e) if tc.on_save_error == OnSaveError::Continue => {
                let line = format!(
                    "the checkpoint of step {step} was not saved: {e:#}; training goes on (train.on_save_error = \"continue\")"
                );
                tracing::warn!("{line}");
                if let Some(log) = self.log.as_mut() {
                    log.write(&json!({"event": "save_failed", "step": step, "error": format!("{e:#}")}))?;
                }
            }
            Err(e) => {
                return Err(e.context(format!(
                    "the checkpoint of step {step} was not saved (earlier checkpoints are intact; train.on_save_error = \"continue\" trains on)"
                )))
            }
        }
        Ok(())
    }

    /// The run's end after a stop signal, once rank 0 has saved: every rank reports it.
    fn interruption(&mut self, signal: i32) -> anyhow::Error {
        self.progress.finish();
        let step = self.state.global_step;
        if let Some(log) = self.log.as_mut() {
            let record =
                json!({"event": "interrupted", "signal": signals::name(signal), "step": step});
            if let Err(e) = log.write(&record) {
                return e;
            }
        }
        Interrupted {
            signal,
            step,
            checkpoint: self
                .last_checkpoint
                .clone()
                .filter(|d| d == &checkpoint::checkpoint_dir(&self.out, step)),
            root: self.dist.is_root(),
        }
        .into()
    }

    /// Evaluates on the held-out set, if there is one (returns whether there was); keeps the
    /// metrics, tracks the best model and decides on early stopping.
    fn evaluate(&mut self, epoch: f64) -> Result<bool> {
        let Some(set) = self.eval.as_deref() else {
            return Ok(false);
        };
        self.opt.settle(); // lazily updated rows, up to this step
        let options = EvalOptions::new(self.config, Some(&self.out));
        if self.stage3().is_none() {
            self.hold_whole_model()?;
        }
        let stage3 = self.stage3().map(|l| (l, &self.opt.flat));
        let mut metrics = evaluate(&self.model, set, &options, self.dist, stage3)?;
        let mut record = json!({"step": self.state.global_step, "epoch": epoch});
        for (k, v) in &metrics {
            record[k] = json!(v);
        }
        self.record(record)?;
        self.track_best(&metrics)?;
        metrics.insert("epoch".into(), epoch);
        self.final_eval = metrics;
        Ok(true)
    }

    /// transformers' best-model bookkeeping and EarlyStoppingCallback, on every rank alike
    /// (the metrics are): an evaluation that does not beat the best so far by more than the
    /// threshold counts towards the patience; one that beats it (strictly) is the new best.
    fn track_best(&mut self, metrics: &BTreeMap<String, f64>) -> Result<()> {
        let ec = &self.config.eval;
        if !self.config.train.load_best_model_at_end && ec.early_stopping_patience == 0 {
            return Ok(());
        }
        let key = ec.best_metric_key();
        let Some(&value) = metrics.get(&key) else {
            bail!(
                "eval.metric_for_best_model: the evaluation has no {key:?} (it has {})",
                metrics.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        };
        let s = &mut self.state;
        let best = s.best_metric;
        if best.is_none_or(|b| ec.improves(value, b, ec.early_stopping_threshold)) {
            s.early_stopping_patience_counter = 0;
        } else {
            s.early_stopping_patience_counter += 1;
        }
        if best.is_none_or(|b| ec.improves(value, b, 0.0)) {
            s.best_metric = Some(value);
            s.best_global_step = Some(s.global_step);
            s.best_model_checkpoint = self
                .config
                .train
                .load_best_model_at_end
                .then(|| checkpoint::checkpoint_dir(&self.out, s.global_step));
        }
        let patience = ec.early_stopping_patience;
        if patience > 0 && s.early_stopping_patience_counter >= patience {
            self.stop = true;
            self.progress.note(&format!(
                "early stopping at step {}: {key} has not improved for {patience} evaluations (best {} at step {})",
                s.global_step,
                s.best_metric.unwrap_or(value),
                s.best_global_step.unwrap_or(0)
            ));
        }
        Ok(())
    }

    /// One record: into metrics.jsonl (rank 0), beside the progress bar, and into the history
    /// checkpoints keep.
    fn record(&mut self, record: Value) -> Result<()> {
        if let Some(log) = self.log.as_mut() {
            log.write(&record)?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.write_record(&record)?;
        }
        self.progress.log(&record);
        self.state.log_history.push(record);
        Ok(())
    }

    /// Says what the run will do, and marks the end of startup in metrics.jsonl (everything
    /// before the first step: libtorch loading, model, data, optimizer).
    fn announce_start(&mut self) -> Result<()> {
        if !self.dist.is_root() {
            return Ok(());
        }
        tracing::info!(
            "{} examples ({} held for evaluation), {} steps of {} examples, {} parameters in {} gradient buckets",
            self.train.len(),
            self.eval.as_ref().map_or(0, |e| e.features().len()),
            self.total_steps,
            self.plan.global_batch(),
            self.opt.flat.numel(),
            self.sync.buckets()
        );
        let startup_s = crate::runtime::sysinfo::process_age_s();
        let unix_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if let Some(log) = self.log.as_mut() {
            log.write(&json!({
                "event": "train_begin", "step": self.state.global_step, "unix_time": unix_time,
                "startup_s": startup_s, "startup_phases": startup::phases(),
            }))?;
        }
        if let Some(s) = startup_s {
            tracing::info!("ready to train {s:.2} s after the process started");
        }
        Ok(())
    }

    /// Flushes rank 0's metrics log and TensorBoard events to the disk.
    fn sync_logs(&self) -> Result<()> {
        if let Some(log) = &self.log {
            log.sync()?;
        }
        self.tensorboard.as_ref().map_or(Ok(()), EventWriter::sync)
    }

    /// Rank 0 saves the final model at the root of the output directory with the results and
    /// the plot; every rank reports.
    fn finish(mut self) -> Result<Summary> {
        self.progress.finish();
        // The best model, loaded on rank 0, is written from its variables.
        let weights = match (self.config.train.load_best_model_at_end)
            && self.state.best_model_checkpoint.is_some()
        {
            true => self.hold_whole_model().map(|()| None)?,
            false => self.stream_weights("final")?,
        };
        let root = self.dist.is_root();
        if let Some(log) = self.log.as_mut() {
            log.write(&json!({
                "event": "train_end", "step": self.state.global_step,
                "peak_rss_mib": crate::runtime::sysinfo::peak_rss_mib(),
            }))?;
        }
        if let (true, Some(best)) = (
            self.config.train.load_best_model_at_end,
            self.state.best_model_checkpoint.clone(),
        ) {
            // The final model, and its results, are the best evaluation's.
            if root {
                checkpoint::load_weights(&best, &self.vs, &self.model)?;
                tracing::info!("final model: the best one, {}", best.display());
            }
            if let Some(record) = self.state.log_history.iter().rev().find(|r| {
                r["step"].as_u64() == self.state.best_global_step.map(|s| s as u64)
                    && r.get("eval_loss").is_some()
            }) {
                self.final_eval = record
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(k, _)| k.starts_with("eval_") || *k == "epoch")
                    .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                    .collect();
            }
        }
        if root {
            self.opt.settle();
            self.save_final(weights)?;
            if !self.final_eval.is_empty() {
                write_eval_results(&self.out, &self.final_eval)?;
            }
            self.sync_logs()?;
            if let Err(e) =
                crate::report::plot(&self.out.join("training.png"), &self.state.log_history)
            {
                tracing::warn!("no plot: {e:#}");
            }
        }
        let wall_s = self.started.elapsed().as_secs_f64();
        let s = &self.state;
        Ok(Summary {
            root,
            output_dir: self.out,
            steps: s.global_step,
            epochs_done: s.epoch as f64 + s.batch_in_epoch as f64 / self.steps_per_epoch as f64,
            train_loss: self.run_totals.mean_loss(),
            wall_s,
            samples_per_s: self.run_totals.samples() as f64 / wall_s,
            eval: self.final_eval,
        })
    }
}
/// The flat parameter buffer, agreed on by every rank and holding rank 0's weights, with its
/// optimizer and gradient buckets (the memory preflight ran before the model was built).
fn training_state(
    config: &Config,
    dist: &Dist,
    p: &mut setup::Prepared,
    total_steps: usize,
) -> Result<(Optimizer, GradSync)> {
    let flat = FlatParams::new(&p.vs, |name| p.model.backward_stage(name));
    // The parameters' first home, freed as they moved into the flat buffer.
    crate::runtime::allocator::release_free_memory();
    agree_and_broadcast(dist, config, &flat, p.train.len())?;
    let sync = GradSync::new(&flat, &p.model, config, dist);
    let mut opt = optimizer(&config.train, flat, total_steps)?;
    shard_optimizer(&mut opt, &sync, config, dist);
    if config.runtime.sparse_embedding_updates {
        defer_embedding_rows(&mut p.model, &mut opt, dist.is_root());
    }
    Ok((opt, sync))
}

/// Under ZeRO, AdamW over this rank's shard alone (and its own gradient at stage 2); says so.
fn shard_optimizer(opt: &mut Optimizer, sync: &GradSync, config: &Config, dist: &Dist) {
    if sync.zero_stage() > 0 {
        let shard = sync.shard(opt.flat.numel() as usize);
        let own_grads = sync.reduces_every_micro_batch();
        opt.adamw = AdamW::sharded(opt.adamw.config, &opt.flat, shard, own_grads);
    }
    announce_zero(config, dist, opt);
}

/// Says, once, what ZeRO shards on this run.
fn announce_zero(config: &Config, dist: &Dist, opt: &Optimizer) {
    let stage = config.dist.zero_stage;
    if stage == 0 || !dist.is_root() {
        return;
    }
    if dist.topo.world == 1 {
        tracing::info!("dist.zero_stage = {stage}: one process, nothing to shard");
        return;
    }
    let (all, mine) = (opt.flat.numel(), opt.adamw.shard().numel());
    let what = match stage {
        1 => "optimizer state",
        2 => "optimizer state and gradients",
        _ => "optimizer state, gradients and parameters",
    };
    tracing::info!(
        "ZeRO stage {stage}: {what} sharded over {} processes (rank 0 keeps {mine} of {all} parameters' state)",
        dist.topo.world
    );
}

/// The trainer state this run starts from: a new one, or the checkpoint's (its AdamW moments
/// restored into `opt`, its data position carried over to this run's batch plan).
fn start_state(
    config: &Config,
    resume_dir: Option<&Path>,
    opt: &mut Optimizer,
    plan: &BatchPlan,
    total_steps: usize,
) -> Result<TrainerState> {
    let layout = opt.flat.layout();
    let mut state = match resume_dir {
        Some(dir) => {
            let mut state = checkpoint::resume(dir, &mut opt.adamw, &layout, total_steps)?;
            continue_data_position(&mut state, plan, config.train.allow_global_batch_change)
                .with_context(|| format!("cannot resume from {}", dir.display()))?;
            state
        }
        None => TrainerState::start(layout, total_steps),
    };
    state.global_batch = plan.global_batch();
    Ok(state)
}

/// Rank 0 readies the output directory (and recovers from a save a kill cut short); with
/// `--resume`, every rank finds the checkpoint to resume (rank 0 says which it passed over).
fn output_and_resume_dirs(
    config: &Config,
    out: &Path,
    resume: Option<&str>,
    root: bool,
) -> Result<Option<PathBuf>> {
    if root {
        prepare_output_dir(out, resume.is_some(), config.train.overwrite_output_dir)?;
        checkpoint::recover(out)?;
    }
    let Some(spec) = resume else {
        return Ok(None);
    };
    let (dir, passed_over) = checkpoint::resume_dir(out, spec)?;
    for line in passed_over.iter().filter(|_| root) {
        tracing::warn!("{line}");
    }
    Ok(Some(dir))
}

/// `runtime.sparse_embedding_updates`: a word-embedding table only the lookup reads gets
/// lazy rows in AdamW.
fn defer_embedding_rows(model: &mut TaskModel, opt: &mut Optimizer, root: bool) {
    let table = model.sparse_lookup_table();
    let deferred = table.and_then(|t| opt.adamw.defer_untouched_rows(&opt.flat, &t));
    if let (true, Some(name)) = (root, deferred) {
        tracing::info!(
            "{name}: sparse gradient; a step updates the rows it looked up, the others when next used (runtime.sparse_embedding_updates)"
        );
    }
}

/// Rank 0's metrics log (appended to when resuming), TensorBoard events and profiler.
fn run_outputs(
    config: &Config,
    out: &Path,
    resumed: bool,
) -> Result<(
    Option<MetricsLog>,
    Option<EventWriter>,
    Option<StepProfiler>,
)> {
    let log = MetricsLog::open(&out.join("metrics.jsonl"), resumed)?;
    let tensorboard = (config.train.report_to.iter().any(|r| r == "tensorboard"))
        .then(|| EventWriter::create(&out.join("runs")))
        .transpose()?;
    let runtime = &config.runtime;
    let profiler = StepProfiler::new(runtime.profile_start_step, runtime.profile_steps, out);
    Ok((Some(log), tensorboard, profiler))
}
