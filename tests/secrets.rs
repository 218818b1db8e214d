//! Hugging Face credentials and Hub names: an HF token (HF_TOKEN, or the token file in
//! HF_HOME) never appears in anything a run writes or prints, and a Hub model id, revision or
//! data path cannot lead outside the cache directory. Offline throughout (HF_HUB_OFFLINE=1).

mod common;

use std::path::Path;

use common::{fixtures, sprtrain, write_sentences, RunConfig};

const ENV_TOKEN: &str = "hf_EnvSecretToken0123456789";
const FILE_TOKEN: &str = "hf_FileSecretToken9876543210";

/// Every file under `dir`, read as bytes.
fn files_under(dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            files_under(&p, out);
        } else {
            out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[test]
fn tokens_never_leak_and_hub_names_stay_in_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    std::fs::create_dir_all(home.join("hub")).unwrap();
    std::fs::write(home.join("token"), FILE_TOKEN).unwrap();
    let data = tmp.path().join("train.tsv");
    write_sentences(&data, 24, 5, |i, _| i % 2);
    let run = |name: &str, edit: &dyn Fn(RunConfig) -> RunConfig| {
        let out = tmp.path().join(name);
        let c = edit(
            RunConfig::new(&fixtures().join("train_parity"), &data, &out)
                .set("data.eval_split", 0.25)
                .set("train.max_steps", 3)
                .set("train.batch_size", 4)
                .set("train.save_steps", 2)
                .set(
                    "train.report_to",
                    toml::Value::Array(vec!["tensorboard".into()]),
                ),
        )
        .write(&tmp.path().join(format!("{name}.toml")));
        let output = sprtrain()
            .arg("--config")
            .arg(&c)
            .env("HF_HOME", &home)
            .env("HF_TOKEN", ENV_TOKEN)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        (output, out)
    };

    // A run that trains, saves checkpoints, evaluates and writes every output file.
    let (ok_run, out) = run("trained", &|c| c);
    assert!(
        ok_run.status.success(),
        "{}",
        String::from_utf8_lossy(&ok_run.stderr)
    );
    let mut written = vec![
        ("stdout".to_string(), ok_run.stdout.clone()),
        ("stderr".to_string(), ok_run.stderr.clone()),
    ];
    files_under(&out, &mut written);
    assert!(
        written.len() > 15,
        "too few outputs to mean anything: {}",
        written.len()
    );
    assert!(written.iter().any(|(n, _)| n.ends_with("sprtrain.toml")));

    // Failing runs: a Hub model not in the cache, names that would leave it.
    type Edit = Box<dyn Fn(RunConfig) -> RunConfig>;
    let failures: Vec<(&str, Edit, &str)> = vec![
        (
            "missing-model",
            Box::new(|c| c.set("model.name_or_path", "org/not-cached")),
            "has no config.json in the Hugging Face cache",
        ),
        (
            "revision-escape",
            Box::new(|c| {
                c.set("model.name_or_path", "org/model")
                    .set("model.revision", "../../../../etc")
            }),
            "model revision \"../../../../etc\" is not a valid Hugging Face Hub name",
        ),
        (
            "data-escape",
            Box::new(|c| {
                c.set(
                    "data.train_file",
                    "hf://datasets/org/name@../../x/train.csv",
                )
            }),
            "revision \"..\" is not a valid Hugging Face Hub name",
        ),
        (
            "file-escape",
            Box::new(|c| {
                c.set(
                    "data.train_file",
                    "hf://datasets/org/name/../../../etc/passwd",
                )
            }),
            "file \"../../../etc/passwd\" is not a valid Hugging Face Hub name",
        ),
    ];
    for (name, edit, want) in &failures {
        let (output, out) = run(name, edit.as_ref());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{name} ran");
        assert!(stderr.contains(want), "{name}: {stderr}");
        written.push((format!("{name} stderr"), output.stderr.clone()));
        written.push((format!("{name} stdout"), output.stdout.clone()));
        if out.is_dir() {
            files_under(&out, &mut written);
        }
    }
    for (name, bytes) in &written {
        for secret in [ENV_TOKEN, FILE_TOKEN] {
            assert!(!contains(bytes, secret), "{name} holds the token");
        }
    }
    // Nothing was written outside the cache by the escaping names.
    assert!(!tmp.path().join("etc").exists());
}
