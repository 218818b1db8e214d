//! sprtrain command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use sprtrain::commands::predict::{self, PredictArgs};
use sprtrain::config::Config;
use sprtrain::models;
use sprtrain::train::setup;

#[derive(Parser)]
#[command(
    name = "sprtrain",
    version,
    about = "Data-parallel training of Hugging Face transformer models on CPU clusters",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    /// Train: the TOML config of the run (see configs/reference.toml).
    #[arg(long, required = true)]
    config: Option<PathBuf>,
    /// Override a config value, e.g. --set train.learning_rate=3e-5 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// Continue from `latest` (the newest checkpoint in train.output_dir) or a checkpoint directory.
    #[arg(long, value_name = "latest|PATH")]
    resume: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CPU features, cores, libtorch build, threads and MPI library that training uses.
    Env,
    /// Continue a prompt with a causal language model (greedy, or sampled with temperature,
    /// top-k and top-p), printing the prompt and its continuation.
    Generate(sprtrain::commands::generate::GenerateArgs),
    /// Fold a LoRA adapter into its base model and write the full model (which transformers
    /// loads without PEFT).
    Merge(sprtrain::commands::merge::MergeArgs),
    /// Build a character-level tokenizer.json (one token per distinct character of a text
    /// file, as nanoGPT's shakespeare_char) with the tokenizers crate.
    CharTokenizer {
        /// The text whose characters make the vocabulary.
        #[arg(long)]
        text: PathBuf,
        /// Where to write tokenizer.json.
        #[arg(long)]
        output: PathBuf,
    },
    /// Estimate a rank's peak memory for a config at several process counts and ZeRO stages,
    /// from config.json alone (nothing is loaded): the memory preflight's model.
    Memory(sprtrain::commands::memory::MemoryArgs),
    /// Run a model over a JSON Lines file and write each example's logits as JSON Lines.
    Predict(PredictArgs),
    /// Validate a config: parse it, apply --set, resolve and load the model and tokenizer
    /// strictly, and print the resolved config.
    Check {
        /// TOML config file.
        #[arg(long)]
        config: PathBuf,
        /// Override a config value, e.g. --set model.max_seq_len=256 (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
    },
    /// Evaluate a saved model on the config's evaluation data, as training's final evaluation
    /// does (SQuAD exact match and F1 for question answering, with predictions.json); runs
    /// sharded under mpirun.
    Eval {
        /// TOML config file (its data, model.task, qa and eval sections are used).
        #[arg(long)]
        config: PathBuf,
        /// Override a config value (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
        /// Model directory: a checkpoint, or any model directory [default: train.output_dir]
        #[arg(long)]
        model: Option<PathBuf>,
        /// Where to write eval_results.json and predictions [default: train.output_dir]
        #[arg(long)]
        output: Option<PathBuf>,
    },
}

fn check(path: &std::path::Path, overrides: &[String]) -> Result<()> {
    let config = Config::from_toml_str(
        &std::fs::read_to_string(path).context("cannot read the file")?,
        overrides,
    )?;
    let (dir, plan) = setup::plan_from_config(&config, true)?;
    let tokenizer = plan.tokenizer_json.clone();
    let pretrained = setup::build_model(&config, plan, config.model.task.head(), true)?;
    let class = pretrained.model.class_name();
    let c = &pretrained.model.config;
    sprtrain::data::tokenizer::TextTokenizer::from_file(
        &tokenizer,
        c.pad_token_id,
        config.model.max_seq_len,
        sprtrain::data::tokenizer::Truncation::LongestFirst,
    )?;
    let params: i64 = pretrained
        .vs
        .variables()
        .values()
        .filter(|t| t.requires_grad())
        .map(|t| t.numel() as i64)
        .sum();
    println!(
        "# {class} from {}: {params} trainable parameters, {} tensors loaded",
        dir.display(),
        pretrained.report.loaded
    );
    print_memory_estimates(&config, &pretrained);
    print!("{}", config.to_toml()?);
    Ok(())
}

/// The preflight's estimate of a rank's peak at 1 to 8 processes, and this machine's memory.
fn print_memory_estimates(config: &Config, pretrained: &models::Pretrained) {
    use sprtrain::train::memory;
    let shape = memory::ModelShape::of(&pretrained.vs, &pretrained.model);
    for world in [1, 2, 4, 8] {
        let run = memory::RunShape::of(config, world);
        let stage = if world > 1 { run.zero_stage } else { 0 };
        println!(
            "# memory a rank needs at {world} process(es), ZeRO stage {stage}: about {}",
            memory::estimate(&shape, &run).describe()
        );
    }
    if let Some((room, source)) = memory::available_per_rank(config.runtime.memory_limit_gb, 1) {
        println!("# memory this machine has: {:.1} GB ({source})", room / 1e9);
    }
}

fn train(path: &std::path::Path, overrides: &[String], resume: Option<&str>) -> Result<()> {
    let config = Config::load(path, overrides)?;
    sprtrain::runtime::allocator::reexec_with(config.runtime.allocator)?;
    sprtrain::runtime::startup::mark("config");
    let summary = sprtrain::train::train(&config, resume)?;
    if !summary.root {
        return Ok(());
    }
    let mut rows = vec![
        (
            "output".to_string(),
            summary.output_dir.display().to_string(),
        ),
        ("steps".to_string(), summary.steps.to_string()),
        ("epochs".to_string(), format!("{:.2}", summary.epochs_done)),
        (
            "train loss".to_string(),
            format!("{:.4}", summary.train_loss),
        ),
        ("wall time".to_string(), format!("{:.1} s", summary.wall_s)),
        (
            "samples/s".to_string(),
            format!("{:.1}", summary.samples_per_s),
        ),
    ];
    rows.extend(
        summary
            .eval
            .iter()
            .map(|(k, v)| (k.clone(), format!("{v:.4}"))),
    );
    println!(
        "training finished\n{}",
        sprtrain::report::summary_table(&rows)
    );
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    let Some(command) = cli.command else {
        let config = cli.config.context("--config is required")?;
        return train(&config, &cli.overrides, cli.resume.as_deref());
    };
    match command {
        Command::Env => {
            // Under mpirun every rank reports where its threads go; rank 0 the machine too.
            let dist = sprtrain::dist::Dist::init(60.0, sprtrain::dist::Transport::Mpi)?;
            let placement = sprtrain::runtime::placement::place_threads(&dist, 0, true)?;
            tch::set_num_threads(placement.count as i32);
            if dist.is_root() {
                print!("{}", sprtrain::commands::env::report());
            }
            let line = format!("placement        {}\n", placement.describe(&dist.topo));
            std::io::Write::write_all(&mut std::io::stdout().lock(), line.as_bytes())?;
        }
        Command::Generate(args) => {
            let continuation = sprtrain::commands::generate::run(&args).context("generate")?;
            let prompt = if args.chat {
                String::new()
            } else {
                args.prompt.clone()
            };
            println!("{prompt}{continuation}");
        }
        Command::Merge(args) => {
            let n = sprtrain::commands::merge::run(&args).context("merge")?;
            eprintln!("merged {n} adapted layers into {}", args.output.display());
        }
        Command::CharTokenizer { text, output } => {
            let n = sprtrain::data::tokenizer::write_char_tokenizer(&text, &output)?;
            eprintln!("wrote {} with {n} characters", output.display());
        }
        Command::Predict(args) => {
            let (n, seconds) = predict::run(&args).context("predict")?;
            eprintln!(
                "wrote {n} predictions to {} in {seconds:.2} s ({:.1} examples/s)",
                args.output.display(),
                n as f64 / seconds.max(1e-9)
            );
        }
        Command::Eval {
            config,
            overrides,
            model,
            output,
        } => {
            let c = Config::load(&config, &overrides)?;
            sprtrain::runtime::allocator::reexec_with(c.runtime.allocator)?;
            if let Some(m) =
                sprtrain::train::evaluate_saved(&c, model.as_deref(), output.as_deref())?
            {
                let rows: Vec<(String, String)> = m
                    .iter()
                    .map(|(k, v)| (k.clone(), format!("{v:.4}")))
                    .collect();
                println!("{}", sprtrain::report::summary_table(&rows));
            }
        }
        Command::Memory(args) => {
            print!("{}", sprtrain::commands::memory::run(&args)?);
        }
        Command::Check { config, overrides } => {
            check(&config, &overrides).with_context(|| format!("config {}", config.display()))?
        }
    }
    Ok(())
}

/// Re-executes under the configured allocator (see `sprtrain::runtime::allocator`) before libtorch's
/// own initialisers run: an entry of the executable's `.preinit_array` runs before those of
/// its shared libraries, so the first process never initialises libtorch (operator
/// registration, 0.3 s of every start). Anything unusual (no config, a config that does not
/// load) leaves the decision to `main`, which reports it.
#[used]
#[link_section = ".preinit_array"]
static EARLY_ALLOCATOR: extern "C" fn(
    std::ffi::c_int,
    *const *const std::ffi::c_char,
    *const *const std::ffi::c_char,
) = early_allocator;

extern "C" fn early_allocator(
    argc: std::ffi::c_int,
    argv: *const *const std::ffi::c_char,
    envp: *const *const std::ffi::c_char,
) {
    use std::os::unix::ffi::OsStrExt;
    extern "C" {
        static mut environ: *const *const std::ffi::c_char;
    }
    sprtrain::runtime::startup::mark("loading");
    if argv.is_null() || envp.is_null() {
        return;
    }
    // SAFETY: one thread runs this early. The C library sets `environ` to the same pointer in
    // its own initialiser, which has not run yet; the standard library's environment reads it.
    unsafe {
        if environ.is_null() {
            environ = envp;
        }
    }
    if sprtrain::runtime::allocator::already_chosen() {
        return; // the re-executed process: nothing to decide
    }
    // SAFETY: the loader passes `argc` NUL-terminated strings in `argv`.
    let args: Vec<std::ffi::OsString> = (0..argc.max(0) as usize)
        .map(|i| unsafe { std::ffi::CStr::from_ptr(*argv.add(i)) })
        .map(|a| std::ffi::OsStr::from_bytes(a.to_bytes()).to_owned())
        .collect();
    let Ok(cli) = Cli::try_parse_from(&args) else {
        return;
    };
    let (config, overrides) = match (&cli.command, &cli.config) {
        (None, Some(config)) => (config, &cli.overrides),
        (
            Some(Command::Eval {
                config, overrides, ..
            }),
            _,
        ) => (config, overrides),
        _ => return,
    };
    if let Ok(c) = Config::load(config, overrides) {
        let _ = sprtrain::runtime::allocator::reexec_with_args(c.runtime.allocator, &args);
    }
}

fn main() -> ExitCode {
    sprtrain::runtime::startup::mark("library_initialisers");
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_writer(std::io::stderr)
        .init();
    // A panic is a bug in sprtrain, but the user still gets one line, not a backtrace.
    if std::env::var_os("RUST_BACKTRACE").is_none() {
        std::panic::set_hook(Box::new(|info| {
            if sprtrain::runtime::panic_guard::is_catching() {
                return; // reported as an error naming the file
            }
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let first = msg.lines().next().unwrap_or("");
            eprintln!("sprtrain: internal error: {first} (RUST_BACKTRACE=1 shows where)");
        }));
    }
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<sprtrain::runtime::signals::Interrupted>() {
            // Every rank stops alike; rank 0 (the one that saved) says so.
            Some(stop) => {
                if stop.root {
                    sprtrain::dist::eprint_line(&format!("sprtrain: {stop}"));
                }
                ExitCode::from(stop.exit_code())
            }
            None => {
                sprtrain::dist::eprint_line(&format!("sprtrain: error: {e:#}"));
                ExitCode::FAILURE
            }
        },
    }
}
