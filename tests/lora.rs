//! LoRA against PEFT 0.21 on the tiny Llama causal-LM fixture: 20 training steps from PEFT's
//! initial adapter give the same losses (<= 1e-4 relative) and adapters (<= 1e-4); PEFT's
//! trained adapter gives the same logits here as in PEFT (<= 1e-5); only the adapters train
//! and cross the wire; the adapters sprtrain writes load in PEFT, and `sprtrain merge` writes
//! a model transformers loads, both with our logits (<= 1e-5).

mod common;

use std::path::Path;

use common::{
    fixtures, max_abs_diff, ok, reference, require_reference_python, sprtrain, RunConfig,
};
use sprtrain::config::TrainConfig;
use sprtrain::models::lora::{read_adapter, with_adapter};
use sprtrain::models::{EncoderInputs, Head, Labels};
use sprtrain::optim::{FlatParams, ScheduleKind};
use sprtrain::train::optimizer;

fn base_dir() -> std::path::PathBuf {
    fixtures().join("parity").join("llama-causal-lm")
}

#[test]
fn twenty_lora_steps_match_peft() {
    let dir = fixtures().join("lora");
    let r = reference(&dir.join("reference.safetensors"));
    let hp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let initial = read_adapter(&dir.join("initial")).unwrap();
    let p = with_adapter(&base_dir(), Head::CausalLm, &initial).unwrap();
    let tc = TrainConfig {
        learning_rate: hp["lr"].as_f64().unwrap(),
        weight_decay: hp["weight_decay"].as_f64().unwrap(),
        warmup_steps: hp["warmup_steps"].as_u64().unwrap() as usize,
        max_grad_norm: hp["max_grad_norm"].as_f64().unwrap(),
        lr_scheduler: ScheduleKind::Linear,
        ..TrainConfig::default()
    };
    let flat = FlatParams::new(&p.vs, |n| p.model.backward_stage(n));
    // Only the adapters train: 2 layers x 4 modules x (A + B).
    assert_eq!(flat.slots.len(), 16);
    assert!(flat.slots.iter().all(|s| s.name.contains(".lora_")));
    let steps = hp["steps"].as_u64().unwrap() as usize;
    let mut opt = optimizer(&tc, flat, steps).unwrap();
    let want: Vec<f64> = Vec::try_from(&r["losses"]).unwrap();
    for step in 0..steps {
        let get = |k: &str| r[&format!("{k}.{step}")].shallow_clone();
        let inputs = EncoderInputs {
            input_ids: get("input_ids"),
            attention_mask: get("attention_mask"),
            token_type_ids: None,
        };
        let out = p.model.forward(&inputs, true);
        let loss = p.model.loss(&out, &Labels::Tokens(get("labels"))).unwrap();
        loss.backward();
        opt.step(step);
        let (got, w) = (loss.double_value(&[]), want[step]);
        let rel = (got - w).abs() / w.abs();
        eprintln!("step {step}: loss {got:.7} vs PEFT {w:.7} (relative {rel:.1e})");
        assert!(rel <= 1e-4, "step {step}: loss {got} vs {w}");
    }
    let final_adapter = read_adapter(&dir.join("final")).unwrap();
    let vars = p.vs.variables();
    for (name, want) in &final_adapter.tensors {
        let d = max_abs_diff(&vars[name], want);
        assert!(d <= 1e-4, "{name} differs by {d:e}");
    }

    // PEFT's trained adapter on the base model: PEFT's logits.
    let trained = with_adapter(&base_dir(), Head::CausalLm, &final_adapter).unwrap();
    let inputs = EncoderInputs {
        input_ids: r["input_ids.0"].shallow_clone(),
        attention_mask: r["attention_mask.0"].shallow_clone(),
        token_type_ids: None,
    };
    let logits = trained.model.forward(&inputs, false).logits;
    let d = max_abs_diff(&logits, &r["final_logits"]);
    eprintln!("PEFT's adapter: logits max abs diff {d:e}");
    assert!(d <= 1e-5, "{d:e}");
}

/// A LoRA run: 2 x 4 adapter tensors train, checkpoints hold the adapters in PEFT's layout,
/// the run resumes from one, an adapter for another base model is refused in one line; with
/// the reference venv, PEFT loads the adapter onto the base model and transformers loads the
/// merged model, both giving our logits.
#[test]
fn lora_runs_save_peft_adapters_and_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("train.txt");
    std::fs::write(
        &text,
        "the cat sat on the mat and the dog sat on the log\n".repeat(40),
    )
    .unwrap();
    let out = tmp.path().join("run");
    let config = RunConfig::new(&base_dir(), &text, &out)
        .set("model.task", "causal-lm")
        .set("train.max_steps", 12)
        .set("train.save_steps", 6)
        .set("train.batch_size", 4)
        .set("train.learning_rate", 1e-2)
        .set("lora.r", 4)
        .set("lora.alpha", 16.0)
        .write(&tmp.path().join("lora.toml"));
    ok(sprtrain().arg("--config").arg(&config).output().unwrap());
    for d in [out.clone(), out.join("checkpoint-6")] {
        assert!(
            d.join("adapter_model.safetensors").is_file(),
            "{}",
            d.display()
        );
        assert!(
            !d.join("model.safetensors").exists(),
            "no full model in {}",
            d.display()
        );
    }
    let saved = read_adapter(&out).unwrap();
    assert_eq!(saved.spec.target_modules, ["q_proj", "v_proj"]);
    // `sprtrain eval` loads the adapter onto the config's base model.
    let evaluated = tmp.path().join("evaluated");
    ok(sprtrain()
        .args(["eval", "--config"])
        .arg(&config)
        .args(["--set", "data.eval_split=0.25", "--output"])
        .arg(&evaluated)
        .output()
        .unwrap());
    let loss = common::eval_results(&evaluated)["eval_loss"]
        .as_f64()
        .unwrap();
    assert!(loss.is_finite() && loss < 6.0, "{loss}");
    assert_eq!(saved.tensors.len(), 2 * 2 * 2);
    // Resuming from the step-6 checkpoint ends where the uninterrupted run ended.
    let resumed_out = tmp.path().join("resumed");
    copy_dir(&out.join("checkpoint-6"), &resumed_out.join("checkpoint-6"));
    ok(sprtrain()
        .arg("--config")
        .arg(&config)
        .args([
            "--set",
            &format!("train.output_dir={}", resumed_out.display()),
        ])
        .args(["--resume", "latest"])
        .output()
        .unwrap());
    let resumed = read_adapter(&resumed_out).unwrap();
    assert_eq!(resumed.tensors.len(), saved.tensors.len());
    for (n, a) in &saved.tensors {
        let b = &resumed.tensors.iter().find(|(m, _)| m == n).unwrap().1;
        assert!(max_abs_diff(a, b) <= 1e-6, "{n}");
    }
    // An adapter on a base model with other shapes: one clear line.
    let run = sprtrain()
        .args(["generate", "--prompt", "the cat", "--model"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success());
    let wrong = tmp.path().join("wrong");
    let merged = tmp.path().join("merged");
    let e = sprtrain()
        .args(["merge", "--adapter"])
        .arg(&out)
        .arg("--base")
        .arg(fixtures().join("parity").join("qwen3-causal-lm"))
        .arg("--output")
        .arg(&wrong)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&e.stderr);
    assert_eq!(e.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("an adapter for a different base model?"),
        "{stderr}"
    );
    ok(sprtrain()
        .args(["merge", "--adapter"])
        .arg(&out)
        .arg("--output")
        .arg(&merged)
        .output()
        .unwrap());

    // Our logits with the adapter, against PEFT's and transformers' on the merged model.
    let p = with_adapter(&base_dir(), Head::CausalLm, &saved).unwrap();
    let ids = tch::Tensor::from_slice(&[3i64, 17, 42, 99, 5, 61]).view([1, 6]);
    let ours = p
        .model
        .forward(
            &EncoderInputs {
                attention_mask: ids.ones_like(),
                input_ids: ids.shallow_clone(),
                token_type_ids: None,
            },
            false,
        )
        .logits;
    let Some(python) = require_reference_python() else {
        return;
    };
    let script = r#"
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, merged, out = sys.argv[1:5]
ids = torch.tensor([[3, 17, 42, 99, 5, 61]])
with torch.no_grad():
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    full = AutoModelForCausalLM.from_pretrained(merged).eval()
    save_file({"peft": peft(input_ids=ids).logits.contiguous(), "merged": full(input_ids=ids).logits.contiguous()}, out)
"#;
    let result = tmp.path().join("logits.safetensors");
    ok(std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(base_dir())
        .arg(&out)
        .arg(&merged)
        .arg(&result)
        .output()
        .unwrap());
    let theirs = reference(&result);
    for key in ["peft", "merged"] {
        let d = max_abs_diff(&ours, &theirs[key]);
        eprintln!("{key}: logits max abs diff {d:e}");
        assert!(d <= 1e-5, "{key}: {d:e}");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// LoRA on a bf16 base (`model.dtype = "bf16"`, as PEFT users load with
/// `torch_dtype=torch.bfloat16`), bf16 compute: 12 steps of the tiny Llama give the fp32
/// base's losses within 1e-3 relative. Under bf16 compute the products already take bf16
/// copies of the weights; what differs is the norms' weights and the embedding rows, rounded
/// to bf16 (4e-3 relative at most each) where they were fp32 (seen: 3e-5). The setting without
/// LoRA, or under fp32 compute, is refused in one line before anything is written.
#[test]
fn lora_on_a_bf16_base_trains_like_the_fp32_base() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("train.txt");
    common::write_numbered_lines(&text);
    let run = |name: &str, sets: &[&str]| {
        let out = tmp.path().join(name);
        let mut config = RunConfig::new(&base_dir(), &text, &out)
            .set("model.task", "causal-lm")
            .set("train.max_steps", 12)
            .set("train.batch_size", 3)
            .set("train.learning_rate", 3e-3)
            .set("runtime.precision", "bf16")
            .set("lora.r", 4);
        for pair in sets.chunks(2) {
            // Numbers as TOML integers, the rest as strings.
            let value = pair[1]
                .parse::<i64>()
                .map_or_else(|_| toml::Value::from(pair[1]), toml::Value::from);
            config = config.set(pair[0], value);
        }
        let path = config.write(&tmp.path().join(format!("{name}.toml")));
        (sprtrain().arg("--config").arg(&path).output().unwrap(), out)
    };
    let (fp32, fp32_out) = run("fp32-base", &[]);
    ok(fp32);
    let (bf16, bf16_out) = run("bf16-base", &["model.dtype", "bf16"]);
    ok(bf16);
    let (want, got) = (common::losses(&fp32_out), common::losses(&bf16_out));
    let worst = common::max_rel_diff(&got, &want);
    eprintln!("bf16 base: losses within {worst:e} of the fp32 base's");
    assert_eq!(got.len(), 12);
    assert!(worst <= 1e-3, "{got:?} vs {want:?}");
    assert!(bf16_out.join("adapter_model.safetensors").exists());

    for (name, sets, line) in [
        (
            "full",
            &["model.dtype", "bf16", "lora.r", "0"][..],
            "model.dtype = \"bf16\" keeps LoRA's frozen base in bf16: set lora.r",
        ),
        (
            "fp32-compute",
            &["model.dtype", "bf16", "runtime.precision", "fp32"][..],
            "model.dtype = \"bf16\" computes in bf16: set runtime.precision = \"bf16\"",
        ),
    ] {
        let (refused, out) = run(name, sets);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{name} was accepted");
        assert!(stderr.contains(line), "{name}: {stderr}");
        assert!(!out.join("checkpoint-12").exists(), "{name} trained");
    }
}
