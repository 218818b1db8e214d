//! The memory preflight (`runtime.memory_preflight`): a run whose estimated peak exceeds the
//! memory each rank has stops before the first step, in one line naming the estimate, the
//! memory and the settings that would fit; with those settings it trains. The node's memory is
//! set with `runtime.memory_limit_gb` so the test does not depend on the machine's.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use sprtrain::config::{Config, LoraConfig};
use sprtrain::models::{from_pretrained, read_config, Head};
use sprtrain::train::memory::{estimate, ModelShape, RunShape};

const BIN: &str = env!("CARGO_BIN_EXE_sprtrain");

/// The tiny Llama on 120 lines of text, a micro-batch of 1024 sequences of 64 tokens: the
/// activations outweigh the model, as for a large batch of a real one.
fn config(dir: &Path) -> (PathBuf, PathBuf) {
    let text = dir.join("train.txt");
    common::write_numbered_lines(&text);
    let llama = common::fixtures().join("parity").join("llama-causal-lm");
    let out = dir.join("out");
    let path = common::RunConfig::new(&llama, &text, &out)
        .set("model.task", "causal-lm")
        .set("model.max_seq_len", 64)
        .set("train.max_steps", 1)
        .set("train.batch_size", 1024)
        .write(&dir.join("run.toml"));
    (path, out)
}

#[test]
fn a_run_that_cannot_fit_stops_at_once_with_settings_that_would() {
    let tmp = tempfile::tempdir().unwrap();
    let (path, _) = config(tmp.path());
    // The estimates the engine will make, from the same model and config.
    let loaded = Config::load(&path, &[]).unwrap();
    let dir = common::fixtures().join("parity").join("llama-causal-lm");
    let p = from_pretrained(&dir, Head::CausalLm, |_| Ok(()), 0).unwrap();
    let shape = ModelShape::of(&p.vs, &p.model);
    let need = |checkpointing: bool| {
        let mut run = RunShape::of(&loaded, 1);
        run.checkpointing = checkpointing;
        estimate(&shape, &run).total() / 1e9
    };
    let (plain, checkpointed) = (need(false), need(true));
    eprintln!("estimates: {plain:.3} GB, {checkpointed:.3} GB with checkpointing");
    assert!(checkpointed < plain, "{checkpointed} vs {plain}");
    let between = format!("runtime.memory_limit_gb={}", (plain + checkpointed) / 2.0);

    let started = Instant::now();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        .args(["--set", &between])
        .output()
        .unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("refused in {seconds:.2} s: {stderr}");
    assert!(!out.status.success());
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    for want in [
        format!("this run needs about {plain:.1} GB (weights"),
        "(runtime.memory_limit_gb); these would fit: train.gradient_checkpointing = true (".into(),
        "runtime.memory_preflight = false skips this check".into(),
    ] {
        assert!(errors[0].contains(&want), "{want:?} not in {stderr}");
    }
    assert!(seconds < 5.0, "took {seconds:.2} s");

    // Nothing fits in less than the runtime's own half gigabyte.
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        .args(["--set", "runtime.memory_limit_gb=0.3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no ZeRO stage or checkpointing fits it: lower train.batch_size or model.max_seq_len, or use more nodes"),
        "{stderr}"
    );

    // With the setting it names, the run trains.
    let ok = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        .args([
            "--set",
            &between,
            "--set",
            "train.gradient_checkpointing=true",
        ])
        .output()
        .unwrap();
    common::ok(ok);
}

/// `sprtrain check` prints the estimate at 1 to 8 processes and the machine's memory.
#[test]
fn check_prints_the_estimate() {
    let tmp = tempfile::tempdir().unwrap();
    let (path, _) = config(tmp.path());
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .args(["--set", "dist.zero_stage=2"])
        .output()
        .unwrap();
    let stdout = common::ok(out);
    for want in [
        "# memory a rank needs at 1 process(es), ZeRO stage 0: about ",
        "# memory a rank needs at 8 process(es), ZeRO stage 2: about ",
        "# memory this machine has: ",
    ] {
        assert!(stdout.contains(want), "{want:?} not in {stdout}");
    }
}

/// The head a parity fixture's directory name says it has (`bert-qa`, `llama-causal-lm`).
fn head_of(name: &str) -> Head {
    let heads = [
        ("-causal-lm", Head::CausalLm),
        ("-mlm", Head::MaskedLm),
        ("-qa", Head::QuestionAnswering),
        ("-token-cls", Head::TokenClassification),
        ("-seq-cls", Head::SequenceClassification),
    ];
    heads
        .iter()
        .find(|(part, _)| name.contains(part))
        .map_or(Head::Base, |(_, head)| *head)
}

/// The preflight counts an uninitialised build of config.json (so that it runs before a model
/// of any size is built): every family's and head's shape from it equals the loaded model's,
/// with and without LoRA adapters.
#[test]
fn the_shape_from_config_json_is_the_loaded_models() {
    let base = Config::from_toml_str("", &[]).unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(common::fixtures().join("parity")).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let head = head_of(&name);
        for r in [0, 4] {
            let lora = LoraConfig {
                r,
                ..LoraConfig::default()
            };
            let hf = read_config(&dir, |c| {
                c.lora = lora.spec(c.arch);
                Ok(())
            })
            .unwrap();
            let planned = ModelShape::planned(&base, hf, head).unwrap();
            let loaded = from_pretrained(
                &dir,
                head,
                |c| {
                    c.lora = lora.spec(c.arch);
                    Ok(())
                },
                0,
            )
            .unwrap();
            let built = ModelShape::of(&loaded.vs, &loaded.model);
            assert_eq!(planned, built, "{name} with LoRA r={r}");
            assert!(built.params > 0.0 && (r == 0) == (built.trainable == built.params));
            checked += 1;
        }
    }
    assert!(checked >= 100, "only {checked} fixtures");
}

/// `sprtrain memory` estimates from config.json alone: Llama-3-70B's shapes (which no machine
/// here could build) give its published parameter count, 70.55B (8.03B for Llama-3-8B), and
/// one row per process count and stage, one process at stage 0 only.
#[test]
fn memory_estimates_a_model_too_large_to_build() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (model, params) in [("llama-70b", "7.055e10"), ("llama-8b", "8.030e9")] {
        let out = Command::new(BIN)
            .current_dir(repo)
            .args(["memory", "--config", "configs/llama-1b-zero3.toml", "--set"])
            .arg(format!("model.name_or_path=configs/models/{model}"))
            .args(["--processes", "1,64", "--stages", "0,3"])
            .output()
            .unwrap();
        let stdout = common::ok(out);
        assert!(
            stdout.contains(&format!("{params} parameters, {params} trainable")),
            "{stdout}"
        );
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| 1")).collect();
        assert_eq!(rows.len(), 1, "{stdout}");
        assert!(rows[0].starts_with("| 1 | 0 | yes |"), "{stdout}");
        let stage3 = stdout.lines().find(|l| l.starts_with("| 64 | 3 | yes |"));
        assert!(stage3.is_some(), "{stdout}");
    }
}
