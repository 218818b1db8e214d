//! Before the first step: where the model comes from and how it is built, the numerics and
//! threads of this process, the output directory, and how an error on one rank stops all.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::Kind;

use super::dataset::MpiShards;
use crate::checkpoint;
use crate::config::{Config, Precision, WeightDtype};
use crate::data::batching::Feature;
use crate::data::masking::Masking;
use crate::dist::Dist;
use crate::io::hf_files::{CONFIG_FILE, TOKENIZER_FILE};
use crate::io::hub;
use crate::models::{self, layers::AutocastGuard, lora, Head, HfConfig, TaskModel};
use crate::runtime::sysinfo::CpuInfo;
use crate::tasks::{EvalSet, TaskData, TokenizeOptions, Tokenized};

/// The model directory, and whether to build it with random weights: `model.random_init`, or
/// the `model.offline_fallback` directory when the Hub cannot be reached.
pub fn resolve_model(config: &Config, report: bool) -> Result<(PathBuf, bool)> {
    let m = &config.model;
    match hub::resolve_model_dir(&m.name_or_path, &m.revision) {
        Ok(dir) => Ok((dir, m.random_init)),
        Err(e) if !m.offline_fallback.is_empty() && !Path::new(&m.name_or_path).exists() => {
            if report {
                tracing::warn!(
                    "cannot get {} from the Hugging Face Hub ({e:#}); building its architecture from {}/config.json with RANDOM weights instead (model.offline_fallback): a smoke run, not a fine-tuning of the pretrained model",
                    m.name_or_path,
                    m.offline_fallback
                );
            }
            Ok((PathBuf::from(&m.offline_fallback), true))
        }
        Err(e) => Err(e),
    }
}

/// Where a model is loaded from, and how.
#[derive(Debug, Clone, Copy)]
pub struct ModelSource<'a> {
    pub dir: &'a Path,
    /// A new run (not a resume): honours `model.tokenizer_file` and `random`.
    pub fresh: bool,
    /// Build from config.json alone with random weights (only when `fresh`).
    pub random: bool,
}

/// What building a run's model takes, resolved before anything is built: the directory and
/// config.json (adapted), a LoRA checkpoint's adapters, and the tokenizer.json.
pub struct ModelPlan {
    /// Where config.json and the weights are (a LoRA checkpoint's base model).
    dir: PathBuf,
    /// Build with random weights.
    random: bool,
    /// The model's config.json as adapted to the run.
    pub hf: HfConfig,
    /// A LoRA checkpoint's adapters, loaded onto the base model.
    adapter: Option<lora::SavedAdapter>,
    pub tokenizer_json: PathBuf,
}

/// Resolves where the run's model comes from (`source`) and reads its config.json, which
/// `adapt` changes.
pub fn plan_model(
    config: &Config,
    source: ModelSource,
    adapt: impl FnOnce(&mut HfConfig) -> Result<()>,
) -> Result<ModelPlan> {
    // A LoRA checkpoint holds the adapters only: the base model is the config's.
    let adapter = (config.lora.r > 0 && lora::is_adapter_dir(source.dir))
        .then(|| lora::read_adapter(source.dir))
        .transpose()?;
    let (dir, random) = match &adapter {
        Some(_) => resolve_model(config, false)?,
        None => (source.dir.to_path_buf(), source.fresh && source.random),
    };
    let hf = models::read_config(&dir, |c| {
        adapt(c)?;
        c.lora = config.lora.spec(c.arch);
        Ok(())
    })?;
    let tokenizer_json = if source.fresh && !config.model.tokenizer_file.is_empty() {
        PathBuf::from(&config.model.tokenizer_file)
    } else {
        source.dir.join(TOKENIZER_FILE)
    };
    Ok(ModelPlan {
        dir,
        random,
        hf,
        adapter,
        tokenizer_json,
    })
}

/// A resumed run goes on with the checkpoint's model. A config whose `model.name_or_path` is
/// another model (another family or other shapes) is refused in one line rather than quietly
/// set aside; where the config's model cannot be read here (a Hub id offline) or the
/// checkpoint holds LoRA adapters alone (the base is the config's), there is nothing to compare.
pub fn check_resumed_model(config: &Config, model_dir: &Path, resume_dir: &Path) -> Result<()> {
    let read = |dir: &Path| HfConfig::from_file(&dir.join(CONFIG_FILE)).ok();
    let (Some(ours), Some(saved)) = (read(model_dir), read(resume_dir)) else {
        return Ok(());
    };
    let shape = |c: &HfConfig| {
        [
            ("model_type", format!("{:?}", c.arch)),
            ("vocab_size", c.vocab_size.to_string()),
            ("hidden_size", c.hidden_size.to_string()),
            ("embedding_size", c.embedding_size.to_string()),
            ("num_hidden_layers", c.num_layers.to_string()),
            ("num_attention_heads", c.num_heads.to_string()),
            ("num_key_value_heads", c.num_kv_heads.to_string()),
            ("head_dim", c.head_dim.to_string()),
            ("intermediate_size", c.intermediate_size.to_string()),
        ]
    };
    let differs = shape(&saved)
        .into_iter()
        .zip(shape(&ours))
        .find(|((_, a), (_, b))| a != b);
    if let Some(((key, there), (_, here))) = differs {
        bail!(
            "--resume {}: the checkpoint holds another model than model.name_or_path = {} ({key} {there} there, {here} here); resume with the config that trained it",
            resume_dir.display(),
            config.model.name_or_path
        );
    }
    Ok(())
}

/// The plan of a new run's model from `config` alone (no data read): `model.name_or_path`
/// resolved (with `report`, saying so where it falls back), `model.num_labels` sizing a new
/// head; and the model's directory.
pub fn plan_from_config(config: &Config, report: bool) -> Result<(PathBuf, ModelPlan)> {
    let (dir, random) = resolve_model(config, report)?;
    let source = ModelSource {
        dir: &dir,
        fresh: true,
        random,
    };
    let labels = (config.model.num_labels > 0).then_some(config.model.num_labels);
    let plan = plan_model(config, source, |c| {
        labels.map_or(Ok(()), |n| c.set_num_labels(n))
    })?;
    Ok((dir, plan))
}

/// Builds the planned model with its `head`; with `report`, says what the load did. Checks
/// `model.max_seq_len` against the model's positions.
pub fn build_model(
    config: &Config,
    plan: ModelPlan,
    head: Head,
    report: bool,
) -> Result<models::Pretrained> {
    let seed = config.runtime.seed as i64;
    let ModelPlan {
        dir,
        random,
        hf,
        adapter,
        ..
    } = plan;
    let loaded = if random {
        models::from_config_with(hf, head, seed)?
    } else {
        models::from_pretrained_with(&dir, hf, head, seed)?
    };
    if let Some(saved) = &adapter {
        lora::load_adapter(&loaded.vs, saved)?;
    }
    if config.model.dtype == WeightDtype::Bf16 {
        frozen_to_bf16(config, &loaded.vs)?;
    }
    let c = &loaded.model.config;
    let usable = c.max_input_tokens();
    if config.model.max_seq_len > usable {
        bail!(
            "model.max_seq_len {} exceeds the {usable} tokens the model's {} position embeddings allow",
            config.model.max_seq_len,
            c.max_position_embeddings
        );
    }
    let class = loaded.model.class_name();
    if report && random {
        tracing::warn!(
            "{class} randomly initialised from {}: no pretrained weights",
            dir.join(CONFIG_FILE).display()
        );
    } else if report {
        for line in loaded.report.summary_lines(&class, &dir) {
            tracing::warn!("{line}");
        }
    }
    Ok(loaded)
}

/// `model.dtype = "bf16"`: the weights that do not train (LoRA's base) kept in bf16, each
/// converted in place (every handle on it sees the new data); they compute in bf16, so bf16
/// compute must be in force.
fn frozen_to_bf16(config: &Config, vs: &tch::nn::VarStore) -> Result<()> {
    if config.runtime.precision.resolve(&CpuInfo::detect()) != Precision::Bf16 {
        bail!("model.dtype = \"bf16\" computes in bf16: set runtime.precision = \"bf16\" (\"auto\" resolved to fp32 on this CPU, which has no bf16 units)");
    }
    for (_, mut var) in vs.variables() {
        if !var.requires_grad() && var.kind() == Kind::Float {
            let half = var.to_kind(Kind::BFloat16);
            var.set_data(&half);
        }
    }
    // The fp32 copies, freed tensor by tensor, back to the system (tcmalloc keeps them).
    crate::runtime::allocator::release_free_memory();
    Ok(())
}

/// A run's model and tokenized data.
pub struct Prepared {
    pub vs: tch::nn::VarStore,
    pub model: TaskModel,
    pub tokenizer_json: PathBuf,
    pub train: Vec<Feature>,
    pub eval: Option<Box<dyn EvalSet>>,
    pub masking: Option<Masking>,
}

/// Builds the model with the task's head from `source`, `data` adapting its config.json
/// (class labels from the training file can fix the head's size), and tokenizes the data
/// once, the work shared between processes; `eval_only` tokenizes only the evaluation data.
pub fn prepare(
    config: &Config,
    dist: &Dist,
    data: Box<dyn TaskData>,
    source: ModelSource,
    eval_only: bool,
) -> Result<Prepared> {
    let root = dist.is_root();
    let head = config.model.task.head();
    let plan = plan_model(config, source, |c| data.adapt(c))?;
    if !eval_only {
        let topo = &dist.topo;
        super::memory::preflight(config, &plan.hf, head, topo.world, topo.local_size)?;
    }
    let tokenizer_json = plan.tokenizer_json.clone();
    let options = TokenizeOptions {
        tokenizer_json: &tokenizer_json,
        pad_id: plan.hf.pad_token_id,
        max_seq_len: config.model.max_seq_len,
        eos_id: plan.hf.eos_token_ids.first().copied(),
    };
    // Tokenizing needs only the tokenizer and config.json's special tokens, so it runs here
    // (it may exchange features over MPI, which this thread alone calls) while a second thread
    // builds the model: the two longest parts of startup, overlapped.
    let (pretrained, tokenized) = std::thread::scope(|s| {
        let builder = s.spawn(|| build_model(config, plan, head, root));
        let tokenized = data.tokenize(&options, &MpiShards(dist), eval_only);
        let pretrained = builder
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (pretrained, tokenized)
    });
    let pretrained = pretrained?;
    let Tokenized {
        train,
        eval,
        masking,
    } = tokenized?;
    crate::runtime::startup::mark("model_and_tokenize");
    Ok(Prepared {
        vs: pretrained.vs,
        model: pretrained.model,
        tokenizer_json,
        train,
        eval,
        masking,
    })
}

/// Resolves the precision (bf16 compute on fp32 master weights, for training and evaluation
/// alike, while the returned guard lives) and places this process's threads.
pub fn set_up_numerics(config: &Config, dist: &Dist) -> Result<AutocastGuard> {
    let precision = config.runtime.precision.resolve(&CpuInfo::detect());
    let autocast =
        models::layers::autocast((precision == Precision::Bf16).then_some(Kind::BFloat16));
    let threads = crate::runtime::placement::place_threads(
        dist,
        config.runtime.threads,
        config.dist.pin_threads,
    )?;
    tch::set_num_threads(threads.count as i32);
    let gemm = config.runtime.fp32_gemm.select()?;
    if dist.is_root() {
        tracing::info!(
            "precision {precision:?}, fp32 products {gemm:?}, {} process(es), allocator {}",
            dist.topo.world,
            crate::runtime::allocator::in_use()
        );
    }
    // The pin map: one line per rank, naming its host and cores, printed once by rank 0.
    let placements = dist.all_gather_bytes("pin map", threads.describe(&dist.topo).into_bytes())?;
    if dist.is_root() {
        let lines: Vec<String> = placements
            .iter()
            .map(|b| String::from_utf8_lossy(b).to_string())
            .collect();
        tracing::info!("pin map:\n  {}", lines.join("\n  "));
    }
    Ok(autocast)
}

/// Refuses to overwrite earlier checkpoints unless asked to, then makes sure `out` exists.
pub fn prepare_output_dir(out: &Path, resume: bool, overwrite: bool) -> Result<()> {
    let existing = checkpoint::list_checkpoints(out)?;
    if !existing.is_empty() && !resume {
        if !overwrite {
            bail!(
                "output directory {} already holds checkpoints ({}); pass --resume latest to continue, or set train.overwrite_output_dir = true",
                out.display(),
                existing.iter().map(|(s, _)| format!("checkpoint-{s}")).collect::<Vec<_>>().join(", ")
            );
        }
        for (_, dir) in existing {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
        }
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("cannot create output directory {}", out.display()))
}

/// Runs `job` as one rank of the job under MPI: with several processes, an error on one is
/// printed with its rank and stops them all (a lone error would leave the others waiting in
/// a collective).
pub fn on_every_rank<T>(
    config: &crate::config::DistConfig,
    job: impl FnOnce(&Dist) -> Result<T>,
) -> Result<T> {
    let dist = Dist::init(config.collective_timeout_s, config.transport)?;
    let _rank =
        (dist.topo.world > 1).then(|| tracing::info_span!("rank", r = dist.topo.rank).entered());
    match job(&dist) {
        // A stop signal ends every rank alike, once rank 0 has saved: no abort, which could
        // end rank 0 mid-save; dropping `dist` waits for all ranks.
        Err(e) if dist.topo.world > 1 && !e.is::<crate::runtime::signals::Interrupted>() => {
            crate::dist::eprint_line(&format!("sprtrain: rank {}: error: {e:#}", dist.topo.rank));
            dist.abort(1)
        }
        r => r,
    }
}
