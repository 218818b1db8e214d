//! Decoder language models end to end: greedy generation token-identical to transformers'
//! `generate` (with the KV cache), chat templates rendered as `apply_chat_template` renders
//! them, causal-LM training on packed text and on instruction data (prompt unscored), and the
//! character-level tokenizer of the Tiny Shakespeare recipe.

mod common;

use std::path::Path;

use common::{eval_results, fixtures, ok, sprtrain, RunConfig};
use serde_json::Value;
use sprtrain::commands::generate::{generate, Sampling};
use sprtrain::data::chat::ChatTemplate;
use sprtrain::models::{from_pretrained, Head};

fn meta(case: &str) -> Value {
    let dir = fixtures().join("parity").join(case);
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// Greedy decoding with the cache equals transformers' for every decoder family: any error in
/// cached positions (rotary offsets, learned positions, the sliding window over cached keys,
/// grouped heads) changes a token within 12 steps.
#[test]
fn greedy_generation_matches_transformers() {
    for case in [
        "gpt2-causal-lm",
        "llama-causal-lm",
        "llama-tied-causal-lm",
        "mistral-causal-lm",
        "qwen2-causal-lm",
        "qwen3-causal-lm",
    ] {
        let g = &meta(case)["generate"];
        let dir = fixtures().join("parity").join(case);
        let p = from_pretrained(&dir, Head::CausalLm, |_| Ok(()), 0).unwrap();
        let new = generate(
            &p.model,
            &ids(&g["prompt_ids"]),
            g["max_new_tokens"].as_u64().unwrap() as usize,
            Sampling::greedy(),
            &[],
            0,
        )
        .unwrap();
        assert_eq!(new, ids(&g["output_ids"]), "{case}");
    }
}

/// The command prints the prompt and the decoded continuation; sampling is seeded.
#[test]
fn generate_command_prints_the_continuation_and_samples_reproducibly() {
    let case = "llama-causal-lm";
    let g = &meta(case)["generate"];
    let dir = fixtures().join("parity").join(case);
    let run = |extra: &[&str]| {
        ok(sprtrain()
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt", g["prompt"].as_str().unwrap()])
            .args(["--max-new-tokens", "12", "--ignore-eos"])
            .args(extra)
            .output()
            .unwrap())
    };
    let greedy = run(&[]);
    let want = format!(
        "{}{}",
        g["prompt"].as_str().unwrap(),
        g["output_text"].as_str().unwrap()
    );
    assert_eq!(greedy.trim_end_matches('\n'), want);
    let sampled = |seed: &str| {
        run(&[
            "--temperature",
            "1.5",
            "--top-k",
            "50",
            "--top-p",
            "0.9",
            "--seed",
            seed,
        ])
    };
    assert_eq!(sampled("7"), sampled("7"), "same seed, same text");
    assert_ne!(sampled("7"), sampled("8"), "another seed, another text");
}

/// Every template renders as transformers renders it (trim_blocks, lstrip_blocks, special
/// tokens, tojson with Python's separators, namespace, loop controls), and a template's
/// raise_exception becomes an error carrying its message.
#[test]
fn chat_templates_render_as_transformers_renders_them() {
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("chat").join("templates.json")).unwrap(),
    )
    .unwrap();
    let specials: Vec<(String, String)> = doc["special_tokens"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    let mut errors = 0;
    for case in doc["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let template = ChatTemplate::new(
            doc["templates"][name].as_str().unwrap().to_string(),
            specials.clone(),
            name.into(),
        )
        .unwrap();
        let messages = case["messages"].as_array().unwrap();
        let prompt = case["add_generation_prompt"].as_bool().unwrap();
        let got = template.render(messages, prompt);
        match case.get("error") {
            Some(e) => {
                let msg = format!("{:#}", got.unwrap_err());
                assert!(msg.contains(e.as_str().unwrap()), "{name}: {msg}");
                errors += 1;
            }
            None => assert_eq!(got.unwrap(), case["expected"].as_str().unwrap(), "{name}"),
        }
    }
    assert!(errors > 0, "no refused conversation was checked");
}

fn lm_config(dir: &Path, train: &Path, name: &str) -> RunConfig {
    RunConfig::new(
        &fixtures().join("parity").join("llama-causal-lm"),
        train,
        &dir.join(name),
    )
    .set("model.task", "causal-lm")
    .set("train.batch_size", 4)
    .set("train.learning_rate", 3e-3)
    .set("runtime.seed", 5)
}

/// Text packed into blocks: the held-out end of the text gets a perplexity that training
/// lowers; without packing, one line per sequence trains too.
#[test]
fn causal_lm_training_lowers_held_out_perplexity() {
    let tmp = tempfile::tempdir().unwrap();
    let train = tmp.path().join("train.txt");
    let line = "the cat sat on the mat and the dog sat on the log\n";
    std::fs::write(&train, line.repeat(60)).unwrap();
    let before = lm_config(tmp.path(), &train, "before")
        .set("data.eval_split", 0.1)
        .set("train.max_steps", 1)
        .set("train.learning_rate", 1e-12)
        .write(&tmp.path().join("before.toml"));
    ok(sprtrain().arg("--config").arg(&before).output().unwrap());
    let after = lm_config(tmp.path(), &train, "after")
        .set("data.eval_split", 0.1)
        .set("train.max_steps", 40)
        .write(&tmp.path().join("after.toml"));
    ok(sprtrain().arg("--config").arg(&after).output().unwrap());
    let (b, a) = (
        eval_results(&tmp.path().join("before")),
        eval_results(&tmp.path().join("after")),
    );
    let (pb, pa) = (
        b["eval_perplexity"].as_f64().unwrap(),
        a["eval_perplexity"].as_f64().unwrap(),
    );
    eprintln!("held-out perplexity {pb:.2} -> {pa:.2}");
    // Random init over a 400-token vocabulary starts near 400; a repeated sentence is learnt.
    assert!(pb > 100.0 && pa < pb / 10.0, "{pb} -> {pa}");
    let loss = a["eval_loss"].as_f64().unwrap();
    assert!((pa - loss.exp()).abs() < 1e-6 * pa);

    let unpacked = lm_config(tmp.path(), &train, "unpacked")
        .set("data.packing", false)
        .set("train.max_steps", 5)
        .write(&tmp.path().join("unpacked.toml"));
    ok(sprtrain().arg("--config").arg(&unpacked).output().unwrap());
    let saved: Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("unpacked").join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(saved["architectures"][0], "LlamaForCausalLM");
}

/// Instruction data: prompt/completion pairs and chat messages train with the completion
/// scored only; a prompt that fills max_seq_len is refused in one line.
#[test]
fn instruction_tuning_scores_completions_only() {
    let tmp = tempfile::tempdir().unwrap();
    let pairs = tmp.path().join("pairs.jsonl");
    let rows: String = (0..24)
        .map(|i| {
            format!(
                "{}\n",
                serde_json::json!({"prompt": format!("Which city is the capital of France? {i}"), "completion": " Paris"})
            )
        })
        .collect();
    std::fs::write(&pairs, rows).unwrap();
    let cfg = lm_config(tmp.path(), &pairs, "pairs")
        .set("train.max_steps", 30)
        .set("data.eval_split", 0.25)
        .write(&tmp.path().join("pairs.toml"));
    ok(sprtrain().arg("--config").arg(&cfg).output().unwrap());
    let r = eval_results(&tmp.path().join("pairs"));
    // Scored per held-out example: the tokens of " Paris" and end-of-sequence, nothing of the
    // prompt.
    let tok =
        tokenizers::Tokenizer::from_file(fixtures().join("parity/llama-causal-lm/tokenizer.json"))
            .unwrap();
    let completion = tok.encode(" Paris", false).unwrap().get_ids().len() as f64;
    assert_eq!(
        r["eval_tokens"].as_f64().unwrap(),
        6.0 * (completion + 1.0),
        "{r}"
    );
    // Far below the ln(400) = 6.0 of the random start: the answer is learnt.
    assert!(r["eval_loss"].as_f64().unwrap() < 4.0, "{r}");

    let long = lm_config(tmp.path(), &pairs, "long")
        .set("model.max_seq_len", 8)
        .set("train.max_steps", 1)
        .write(&tmp.path().join("long.toml"));
    let run = sprtrain().arg("--config").arg(&long).output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    let last = stderr.trim().lines().last().unwrap();
    assert!(
        last.contains("leaves no room for its completion within model.max_seq_len = 8"),
        "{stderr}"
    );
}

/// The committed character tokenizer is the one `char-tokenizer` builds from the text, and it
/// round-trips the text.
#[test]
fn char_tokenizer_matches_the_committed_one() {
    let text =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare/input.txt");
    let Some(text) = common::require(
        text.is_file().then_some(text),
        "../shared/data/tinyshakespeare is absent",
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let built = tmp.path().join("tokenizer.json");
    ok(sprtrain()
        .args(["char-tokenizer", "--text"])
        .arg(&text)
        .arg("--output")
        .arg(&built)
        .output()
        .unwrap());
    let committed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/models/gpt2-shakespeare-char/tokenizer.json");
    assert_eq!(
        std::fs::read_to_string(&built).unwrap(),
        std::fs::read_to_string(&committed).unwrap()
    );
    let tok = tokenizers::Tokenizer::from_file(&committed).unwrap();
    let sample = "First Citizen:\nBefore we proceed any further, hear me speak.\n";
    let enc = tok.encode(sample, true).unwrap();
    assert_eq!(enc.get_ids().len(), sample.chars().count());
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), sample);
}

/// configs/llama-chat-smoke.toml as shipped (fewer steps): chat turns rendered with the model's
/// ChatML template, replies scored; the held-out replies' loss falls far below the random
/// start's ln(400) = 6.0, and the trained model answers in the template's format.
#[test]
fn chat_smoke_config_trains() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smoke");
    ok(sprtrain()
        .current_dir(root)
        .args(["--config", "configs/llama-chat-smoke.toml"])
        .args(["--set", &format!("train.output_dir={}", out.display())])
        .args([
            "--set",
            "train.max_steps=150",
            "--set",
            "runtime.precision=fp32",
        ])
        .output()
        .unwrap());
    let r = eval_results(&out);
    eprintln!("{r}");
    assert!(r["eval_loss"].as_f64().unwrap() < 1.5, "{r}");
    let reply = ok(sprtrain()
        .args([
            "generate",
            "--chat",
            "--prompt",
            "What is 2 plus 5?",
            "--max-new-tokens",
            "12",
            "--model",
        ])
        .arg(&out)
        .output()
        .unwrap());
    assert!(reply.contains(" plus "), "{reply}");
}
