//! `sprtrain memory`: the memory preflight's estimate of a rank's peak for a config at the
//! process counts and ZeRO stages asked for, from config.json alone (no weights are read or
//! built, so a 70B model is estimated on a laptop), as DeepSpeed's
//! `estimate_zero3_model_states_mem_needs_all_live` does for its stages.

use std::path::PathBuf;

use anyhow::Result;

use crate::config::Config;
use crate::train::memory::{available_per_rank, estimate, ModelShape, RunShape};
use crate::train::setup::plan_from_config;

const GB: f64 = 1e9;

/// `sprtrain memory` options.
#[derive(Debug, Clone, clap::Args)]
pub struct MemoryArgs {
    /// TOML config file of the run.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a config value, e.g. --set train.batch_size=2 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// The process counts (world sizes) to estimate at.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8])]
    pub processes: Vec<usize>,
    /// The ZeRO stages to estimate [default: the config's].
    #[arg(long, value_delimiter = ',')]
    pub stages: Vec<u8>,
}

/// Prints, as a Markdown table, a rank's estimated peak for each process count and stage, with
/// the config's activation checkpointing and, where it is off, with it on.
pub fn run(args: &MemoryArgs) -> Result<String> {
    let config = Config::load(&args.config, &args.overrides)?;
    let (dir, plan) = plan_from_config(&config, false)?;
    let shape = ModelShape::planned(&config, plan.hf, config.model.task.head())?;
    let stages = match args.stages.is_empty() {
        true => vec![config.dist.zero_stage],
        false => args.stages.clone(),
    };
    let mut out = format!(
        "# {:?} from {}: {:.3e} parameters, {:.3e} trainable; a micro-batch of {} x {} tokens\n",
        config.model.task,
        dir.join(crate::io::hf_files::CONFIG_FILE).display(),
        shape.params,
        shape.trainable,
        config.train.batch_size,
        RunShape::of(&config, 1).seq
    );
    out.push_str("| processes | ZeRO stage | checkpointing | weights | gradients | optimizer state | send buffers | activations | runtime | a rank's peak (GB) |\n");
    out.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for &world in &args.processes {
        // One process has nothing to shard: stage 0 alone.
        let stages = if world > 1 { &stages[..] } else { &[0][..] };
        for &stage in stages {
            for checkpointing in checkpointing_choices(&config) {
                let run = RunShape {
                    zero_stage: stage,
                    checkpointing,
                    ..RunShape::of(&config, world)
                };
                let e = estimate(&shape, &run);
                let parts = [
                    e.weights,
                    e.gradients,
                    e.optimizer,
                    e.send_buffers,
                    e.activations,
                    e.runtime,
                    e.total(),
                ];
                let gb: Vec<String> = parts.iter().map(|b| format!("{:.2}", b / GB)).collect();
                let yes_no = if checkpointing { "yes" } else { "no" };
                out.push_str(&format!(
                    "| {world} | {stage} | {yes_no} | {} |\n",
                    gb.join(" | ")
                ));
            }
        }
    }
    if let Some((room, source)) = available_per_rank(config.runtime.memory_limit_gb, 1) {
        out.push_str(&format!(
            "# this machine has {:.1} GB ({source}), shared by its ranks\n",
            room / GB
        ));
    }
    Ok(out)
}

/// The config's activation checkpointing, and on where it is off.
fn checkpointing_choices(config: &Config) -> Vec<bool> {
    match config.train.gradient_checkpointing {
        true => vec![true],
        false => vec![false, true],
    }
}
