//! `sprtrain --config` end to end on a tiny model: exact resume, checkpoints transformers
//! loads, and bad input refused with one clear line.

mod common;

use std::path::{Path, PathBuf};

use common::{
    encode_batch, ok, require_reference_python, sprtrain, train_losses, weight_values, RunConfig,
};
use serde_json::Value;
use sprtrain::models::weights::read_safetensors;

use common::{
    tiny_classifier as tiny_model, tiny_classifier_data as write_data,
    tiny_classifier_run as run_config,
};

/// Writes `config` beside the output directory it names.
fn write(dir: &Path, out: &Path, config: RunConfig) -> PathBuf {
    config.write(&dir.join(format!(
        "run-{}.toml",
        out.file_name().unwrap().to_string_lossy()
    )))
}

fn write_config(dir: &Path, data: &Path, out: &Path) -> PathBuf {
    write(dir, out, run_config(data, out))
}

fn run(args: &[&str]) -> std::process::Output {
    sprtrain().args(args).output().unwrap()
}

/// 4 steps + resume + 4 steps equals 8 uninterrupted steps, bitwise: same batches in the same
/// order, same dropout masks, same optimizer state.
#[test]
fn resume_continues_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let full = tmp.path().join("full");
    let config = write_config(tmp.path(), &data, &full);
    ok(run(&["--config", config.to_str().unwrap()]));
    assert!(full.join("checkpoint-4").is_dir() && full.join("checkpoint-8").is_dir());

    // A second run that only ever had checkpoint-4, as if killed after it.
    let part = tmp.path().join("part");
    std::fs::create_dir(&part).unwrap();
    let src = full.join("checkpoint-4");
    let dst = part.join("checkpoint-4");
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let config_b = write_config(tmp.path(), &data, &part);
    let stderr = ok(run(&[
        "--config",
        config_b.to_str().unwrap(),
        "--resume",
        "latest",
    ]));
    assert!(
        stderr.contains("resumed from") && stderr.contains("at step 4"),
        "{stderr}"
    );

    let (a, b) = (train_losses(&full), train_losses(&part));
    assert_eq!(a.len(), 8);
    assert_eq!(b.iter().map(|x| x.0).collect::<Vec<_>>(), [5, 6, 7, 8]);
    for (step, loss) in &b {
        let want = a[*step as usize - 1].1;
        assert_eq!(
            *loss, want,
            "step {step}: resumed loss {loss} vs uninterrupted {want}"
        );
    }
    assert_eq!(
        weight_values(&full),
        weight_values(&part),
        "final weights differ"
    );
    assert_eq!(
        weight_values(&full.join("checkpoint-8")),
        weight_values(&full)
    );
    // The losses moved: the check is not comparing constants.
    assert!(a.iter().any(|x| (x.1 - a[0].1).abs() > 1e-3), "{a:?}");
}

/// Sparse embedding gradients with lazily updated rows (the default) train as the dense
/// update does, bit for bit: 12 steps of one micro-batch, with no checkpoint or evaluation
/// bringing the rows up to date on the way. (With accumulation, a sparse gradient adds a
/// micro-batch's rows into the sum one by one, the dense one as a (V, C) tensor: the same
/// values up to rounding, and `resume_continues_exactly` trains that way.)
#[test]
fn lazy_embedding_rows_train_as_dense_updates() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let mut runs = Vec::new();
    for sparse in [true, false] {
        let out = tmp.path().join(format!("sparse-{sparse}"));
        let config = run_config(&data, &out)
            .set("train.max_steps", 12)
            .set("train.gradient_accumulation_steps", 1)
            .set("train.save_steps", 0)
            .set("eval.strategy", "no")
            .set("runtime.sparse_embedding_updates", sparse);
        let stderr = ok(run(&[
            "--config",
            write(tmp.path(), &out, config).to_str().unwrap(),
        ]));
        assert_eq!(
            stderr.contains("bert.embeddings.word_embeddings.weight: sparse gradient"),
            sparse,
            "{stderr}"
        );
        runs.push((train_losses(&out), weight_values(&out)));
    }
    let ((lazy_losses, lazy), (dense_losses, dense)) = (&runs[0], &runs[1]);
    assert_eq!(lazy_losses.len(), 12);
    assert_eq!(lazy_losses, dense_losses);
    let mut moved = 0.0f32;
    for ((name, a), (_, b)) in lazy.iter().zip(dense) {
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-6 * y.abs().max(1e-2),
                "{name}: {x} vs {y}"
            );
        }
        if name == "bert.embeddings.word_embeddings.weight" {
            let before = (1..=3)
                .flat_map(|k| {
                    let shard = tiny_model().join(format!("model-0000{k}-of-00003.safetensors"));
                    read_safetensors(&shard).unwrap()
                })
                .find(|(n, _)| n == name)
                .map(|(_, t)| Vec::<f32>::try_from(t.view([-1])).unwrap())
                .unwrap();
            moved = a
                .iter()
                .zip(&before)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
        }
    }
    assert!(moved > 1e-4, "the word embeddings did not train: {moved}");
}

/// `runtime.fp32_gemm`: the fp32 products through oneDNN train the tiny BERT as the BLAS does,
/// to rounding (8 steps with accumulation, dropout and AdamW), and "blas+brgemm" resolves and
/// trains too (the tiny BERT's short sequences take the batched attention, whose products stay
/// ATen's: tests/fp32_gemm.rs checks the per-pair path); where oneDNN's matmul does not run on
/// the CPU, asking for it is refused with one line.
#[test]
fn fp32_products_through_onednn_train_as_through_the_blas() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let mut runs = Vec::new();
    for (gemm, name) in [
        ("blas", "Blas"),
        ("blas+brgemm", "BlasBrgemm"),
        ("onednn", "Onednn"),
    ] {
        let out = tmp.path().join(gemm);
        let config = run_config(&data, &out)
            .set("train.save_steps", 0)
            .set("eval.strategy", "no")
            .set("runtime.precision", "fp32")
            .set("runtime.fp32_gemm", gemm)
            // The profiler names oneDNN's products as it names at::mm.
            .set("runtime.profile_steps", 2)
            .set("runtime.profile_start_step", 3);
        let output = run(&[
            "--config",
            write(tmp.path(), &out, config).to_str().unwrap(),
        ]);
        let text = String::from_utf8_lossy(&output.stderr).to_string();
        if gemm == "onednn" && !sprtrain::runtime::sysinfo::CpuInfo::detect().avx512_bw_vl_dq {
            assert!(!output.status.success());
            assert!(text.contains("runtime.fp32_gemm = \"onednn\""), "{text}");
            eprintln!("skipped the comparison with oneDNN's matmul: it does not run on this CPU");
            break;
        }
        let text = ok(output);
        assert!(text.contains(&format!("fp32 products {name}")), "{text}");
        let ops = std::fs::read_to_string(out.join("profile").join("ops.md")).unwrap();
        assert_eq!(
            ops.contains("| `sprtrain::onednn_mm` |"),
            gemm == "onednn",
            "{ops}"
        );
        runs.push((gemm, train_losses(&out), weight_values(&out)));
    }
    let (_, blas_losses, blas) = &runs[0];
    assert_eq!(blas_losses.len(), 8);
    for (gemm, losses, weights) in &runs[1..] {
        // Two libraries sum in different orders: fp32 rounding (~1e-7 relative a product) grows
        // through 8 updates, but stays orders of magnitude below 1e-4.
        for ((step, a), (_, b)) in blas_losses.iter().zip(losses) {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs(),
                "{gemm}, step {step}: {a} vs {b}"
            );
        }
        for ((name, a), (_, b)) in blas.iter().zip(weights) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-4 * y.abs().max(1e-2),
                    "{gemm}, {name}: {x} vs {y}"
                );
            }
        }
    }
    assert!(
        blas_losses
            .iter()
            .any(|x| (x.1 - blas_losses[0].1).abs() > 1e-3),
        "{blas_losses:?}"
    );
}

/// `runtime.profile_steps`: libtorch's profiler over steps 3 and 4 of 5 writes a Chrome trace
/// and a table of the operators those steps ran, and changes nothing of the training.
#[test]
fn profile_steps_write_a_trace_and_a_table_of_operators() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let mut losses = Vec::new();
    for steps in [0, 2] {
        let out = tmp.path().join(format!("profile-{steps}"));
        let config = run_config(&data, &out)
            .set("train.max_steps", 5)
            .set("train.save_steps", 0)
            .set("eval.strategy", "no")
            .set("runtime.profile_steps", steps)
            .set("runtime.profile_start_step", 3)
            // libtorch's own products (aten::addmm, aten::mm), checked below by name.
            .set("runtime.fp32_gemm", "blas");
        let stderr = ok(run(&[
            "--config",
            write(tmp.path(), &out, config).to_str().unwrap(),
        ]));
        losses.push(train_losses(&out));
        let profile = out.join("profile");
        if steps == 0 {
            assert!(!profile.exists(), "profiled without profile_steps");
            continue;
        }
        assert!(stderr.contains("operator profile:"), "{stderr}");
        let trace: Value =
            serde_json::from_str(&std::fs::read_to_string(profile.join("trace.json")).unwrap())
                .unwrap();
        let count = |name: &str| {
            trace["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["name"] == name)
                .count()
        };
        // Every step runs the classifier's linear layers and one backward.
        let addmm = count("aten::addmm");
        assert!(
            addmm > 0 && count("aten::mm") > 0,
            "no products in the trace"
        );
        let table = std::fs::read_to_string(profile.join("ops.md")).unwrap();
        assert!(table.starts_with("# Operator profile: 2 steps,"), "{table}");
        let row = table
            .lines()
            .find(|l| l.starts_with("| `aten::addmm` |"))
            .unwrap_or_else(|| panic!("no addmm row: {table}"));
        let per_step: f64 = row.split('|').nth(2).unwrap().trim().parse().unwrap();
        assert_eq!(per_step, addmm as f64 / 2.0, "{row}");
    }
    assert_eq!(losses[0].len(), 5);
    assert_eq!(losses[0], losses[1], "profiling changed the training");
}

/// A checkpoint loads in transformers 5.23.0 with no missing or unexpected keys and gives the
/// same logits (within 1e-5) as sprtrain on the same token ids: in one model.safetensors, and
/// split into shards by `train.save_max_shard_size` (30 KB: the tiny model's 87 KB in 4).
#[test]
fn checkpoint_loads_in_transformers() {
    let Some(python) = require_reference_python() else {
        return;
    };
    check_loads_in_transformers(&python, None);
    check_loads_in_transformers(&python, Some("30KB"));
}

fn check_loads_in_transformers(python: &Path, max_shard_size: Option<&str>) {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let out = tmp.path().join("out");
    let config = write_config(tmp.path(), &data, &out);
    let shard_setting = format!(
        "train.save_max_shard_size={}",
        max_shard_size.unwrap_or("5GB")
    );
    ok(run(&[
        "--config",
        config.to_str().unwrap(),
        "--set",
        "train.max_steps=4",
        "--set",
        &shard_setting,
    ]));
    let ckpt = out.join("checkpoint-4");
    let shards = (1..=4)
        .filter(|k| {
            ckpt.join(format!("model-0000{k}-of-00004.safetensors"))
                .is_file()
        })
        .count();
    let (single, index) = (
        ckpt.join("model.safetensors").is_file(),
        ckpt.join("model.safetensors.index.json").is_file(),
    );
    match max_shard_size {
        None => assert!(single && !index && shards == 0),
        Some(_) => assert!(!single && index && shards == 4, "{single} {index} {shards}"),
    }

    // Token ids through sprtrain's own tokenizer, logits through sprtrain.
    let tok = sprtrain::data::tokenizer::TextTokenizer::from_file(
        &ckpt.join("tokenizer.json"),
        0,
        32,
        sprtrain::data::tokenizer::Truncation::LongestFirst,
    )
    .unwrap();
    let inputs = encode_batch(
        &tok,
        &[
            "the movie was a delight",
            "dull film",
            "paris city day story the",
        ],
    );
    let p = sprtrain::models::from_pretrained(
        &ckpt,
        sprtrain::models::Head::SequenceClassification,
        |_| Ok(()),
        0,
    )
    .unwrap();
    assert!(p.report.newly_initialised.is_empty() && p.report.unused.is_empty());
    let ours = tch::no_grad(|| p.model.forward(&inputs, false).logits);
    let as_lists = |t: &tch::Tensor| -> Vec<Vec<i64>> { Vec::<Vec<i64>>::try_from(t).unwrap() };
    let ids = serde_json::json!({
        "input_ids": as_lists(&inputs.input_ids),
        "attention_mask": as_lists(&inputs.attention_mask),
        "token_type_ids": as_lists(inputs.token_type_ids.as_ref().unwrap()),
    });
    let ids_path = tmp.path().join("ids.json");
    std::fs::write(&ids_path, ids.to_string()).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join("check_transformers_load.py");
    let res = std::process::Command::new(python)
        .arg(script)
        .arg(&ckpt)
        .arg(&ids_path)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let report: Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(report["missing_keys"], serde_json::json!([]), "{report}");
    assert_eq!(report["unexpected_keys"], serde_json::json!([]), "{report}");
    assert_eq!(report["mismatched_keys"], serde_json::json!([]), "{report}");
    assert_eq!(
        report["id2label"],
        serde_json::json!({"0": "0", "1": "1", "2": "2"})
    );
    let theirs: Vec<Vec<f32>> = serde_json::from_value(report["logits"].clone()).unwrap();
    let ours: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(&ours).unwrap();
    let d = ours
        .iter()
        .flatten()
        .zip(theirs.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("sprtrain checkpoint in transformers: max abs logit diff {d:e}");
    assert!(d <= 1e-5, "logits differ by {d}");
}

/// One stderr line, exit 1, naming what is wrong.
fn fails(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or("").to_string();
    assert!(last.starts_with("sprtrain: error: "), "{stderr}");
    eprintln!("{last}");
    last
}

#[test]
fn bad_training_input_is_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let good = write_data(tmp.path());
    let out = tmp.path().join("out");
    let cfg = |data: &Path| write_config(tmp.path(), data, &out);
    let bad_file = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };

    let missing_col = bad_file("missing.tsv", "sentence\tlabel\nthe movie\t1\ndull film\n");
    let e = fails(&["--config", cfg(&missing_col).to_str().unwrap()]);
    assert!(
        e.contains(&format!(
            "{}:3: missing label column",
            missing_col.display()
        )),
        "{e}"
    );

    let bad_number = bad_file(
        "reg.tsv",
        "sentence\tlabel\nthe movie\t0.5\ndull film\tabc\n",
    );
    let e = fails(&[
        "--config",
        cfg(&bad_number).to_str().unwrap(),
        "--set",
        "model.problem_type=regression",
    ]);
    assert!(e.contains(":3: label \"abc\" is not a number"), "{e}");

    let unknown = bad_file(
        "names.tsv",
        "sentence\tlabel\nthe movie\tpos\ndull film\tneutral\n",
    );
    let e = fails(&[
        "--config",
        cfg(&unknown).to_str().unwrap(),
        "--set",
        "data.label_names=[\"neg\", \"pos\"]",
    ]);
    assert!(
        e.contains(":3: unknown label \"neutral\" (labels: neg, pos)"),
        "{e}"
    );

    let empty = bad_file("empty.tsv", "sentence\tlabel\n");
    let e = fails(&["--config", cfg(&empty).to_str().unwrap()]);
    assert!(
        e.contains(&format!("data file {} holds no examples", empty.display())),
        "{e}"
    );

    let e = fails(&[
        "--config",
        cfg(&good).to_str().unwrap(),
        "--set",
        "model.max_seq_len=100",
    ]);
    assert!(
        e.contains("model.max_seq_len 100 exceeds the 64 tokens"),
        "{e}"
    );
    let e = fails(&[
        "--config",
        cfg(&good).to_str().unwrap(),
        "--set",
        "train.batch_size=0",
    ]);
    assert!(e.contains("train.batch_size: must be at least 1"), "{e}");
    let e = fails(&[
        "--config",
        cfg(&good).to_str().unwrap(),
        "--set",
        "train.save_max_shard_size=5XB",
    ]);
    assert!(
        e.contains(r#"train.save_max_shard_size: "5XB": unknown unit "XB""#),
        "{e}"
    );
    let e = fails(&[
        "--config",
        cfg(&tmp.path().join("nope.tsv")).to_str().unwrap(),
    ]);
    assert!(e.contains("nope.tsv does not exist"), "{e}");

    // skip_bad_rows: a warning with the count, and training goes on.
    let mixed = bad_file(
        "mixed.tsv",
        &(std::fs::read_to_string(&good).unwrap() + "broken row\nalso broken\tzzz\n"),
    );
    let stderr = ok(run(&[
        "--config",
        cfg(&mixed).to_str().unwrap(),
        "--set",
        "data.skip_bad_rows=true",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.save_steps=0",
    ]));
    assert!(stderr.contains("skipped 2 bad rows"), "{stderr}");

    // An output directory with checkpoints is not overwritten without --resume or overwrite.
    let before = std::fs::read(out.join("checkpoint-1").join("model.safetensors")).unwrap();
    let e = fails(&["--config", cfg(&good).to_str().unwrap()]);
    assert!(
        e.contains("already holds checkpoints (checkpoint-1)") && e.contains("--resume latest"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(out.join("checkpoint-1").join("model.safetensors")).unwrap(),
        before
    );
}

/// Leftovers of a killed save are never taken for checkpoints.
#[test]
fn partial_checkpoints_are_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join(".checkpoint-9.partial")).unwrap();
    std::fs::create_dir_all(tmp.path().join("checkpoint-7")).unwrap(); // no trainer_state.json
    std::fs::create_dir_all(tmp.path().join("checkpoint-3")).unwrap();
    std::fs::write(
        tmp.path().join("checkpoint-3").join("trainer_state.json"),
        "{}",
    )
    .unwrap();
    let found = sprtrain::checkpoint::list_checkpoints(tmp.path()).unwrap();
    assert_eq!(found.iter().map(|f| f.0).collect::<Vec<_>>(), [3]);
}

/// Where Debian (setup.sh) puts tcmalloc, if it is installed.
fn system_tcmalloc() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .map(|d| Path::new(d).join("libtcmalloc_minimal.so.4"))
    .find(|p| p.is_file())
}

#[test]
fn tcmalloc_is_preloaded_and_startup_and_peak_memory_are_logged() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let tcmalloc = system_tcmalloc();
    for choice in ["auto", "system"] {
        let out = tmp.path().join(choice);
        let config = write(
            tmp.path(),
            &out,
            run_config(&data, &out).set("runtime.allocator", choice),
        );
        let stderr = ok(run(&[
            "--config",
            config.to_str().unwrap(),
            "--set",
            "train.max_steps=2",
        ]));
        let line = stderr
            .lines()
            .find(|l| l.contains(", allocator "))
            .unwrap_or_else(|| panic!("no allocator line:\n{stderr}"));
        let want = match (choice, &tcmalloc) {
            ("auto", Some(lib)) => lib.display().to_string(),
            ("auto", None) => {
                eprintln!("no libtcmalloc_minimal.so.4 here: auto falls back to the system's");
                "system".into()
            }
            _ => "system".into(),
        };
        assert!(line.ends_with(&format!("allocator {want}")), "{line}");
        // The re-executed process trained with the same arguments.
        assert_eq!(train_losses(&out).len(), 2);
        let records: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let begin = &records[0];
        assert_eq!(begin["event"], "train_begin");
        // From exec to the first step: a tiny model loads in well under a minute.
        let startup = begin["startup_s"].as_f64().unwrap();
        assert!(startup > 0.0 && startup < 60.0, "{begin}");
        // Its phases, in order, add up to it: both count from the process's start, which
        // /proc gives to 10 ms; the two readings of it are a moment apart.
        let phases = begin["startup_phases"].as_object().unwrap();
        let names: Vec<&str> = phases.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "loading_s",
                "library_initialisers_s",
                "config_s",
                "mpi_init_s",
                "threads_s",
                "read_data_s",
                "model_and_tokenize_s",
                "optimizer_s",
                "until_first_step_s"
            ]
        );
        let sum: f64 = phases.values().map(|v| v.as_f64().unwrap()).sum();
        assert!((sum - startup).abs() < 0.05, "{sum} vs {startup}: {begin}");
        let end = records.last().unwrap();
        assert_eq!(end["event"], "train_end");
        // libtorch alone maps tens of MB; nothing here needs 8 GB.
        let peak = end["peak_rss_mib"].as_f64().unwrap();
        assert!(peak > 20.0 && peak < 8192.0, "{end}");
    }
}

/// The plot's text comes from a font embedded in the binary: it links neither fontconfig nor
/// FreeType, so nodes need neither installed (ldd lists the libraries it would load).
#[test]
fn the_binary_links_no_font_libraries() {
    let Some(ldd) = common::require(
        std::process::Command::new("ldd")
            .arg(env!("CARGO_BIN_EXE_sprtrain"))
            .output()
            .ok()
            .filter(|o| o.status.success()),
        "no ldd",
    ) else {
        return;
    };
    let libs = String::from_utf8_lossy(&ldd.stdout).to_string();
    assert!(libs.contains("libtorch"), "{libs}");
    for font_lib in ["libfontconfig", "libfreetype"] {
        assert!(
            !libs.contains(font_lib),
            "the binary links {font_lib}:\n{libs}"
        );
    }
}
