//! `hf://datasets/OWNER/NAME` resolved by config and split name, offline, on a fake Hugging
//! Face cache laid out as hf-hub and `datasets` leave it (refs/main -> a snapshot holding
//! the dataset card and GLUE's Parquet files): the card's `configs:` pick the files.

mod common;

use std::path::Path;

use common::{fixtures, ok, sprtrain, RunConfig};

const CARD: &str = "---\nlicense: other\nconfigs:\n- config_name: cola\n  data_files:\n  - split: train\n    path: cola/train-*\n- config_name: mrpc\n  data_files:\n  - split: train\n    path: mrpc/train-*\n  - split: validation\n    path: mrpc/validation-*\n---\n# GLUE\n";

/// A cache with nyu-mll/glue at commit abc123: mrpc's train and validation splits and cola's
/// train split are each the 5-row fixture Parquet file.
fn fake_cache(home: &Path) {
    let repo = home.join("hub").join("datasets--nyu-mll--glue");
    let snapshot = repo.join("snapshots").join("abc123");
    for dir in ["cola", "mrpc"] {
        std::fs::create_dir_all(snapshot.join(dir)).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "abc123").unwrap();
    std::fs::write(snapshot.join("README.md"), CARD).unwrap();
    let pairs = fixtures().join("data").join("pairs.parquet");
    std::fs::copy(&pairs, snapshot.join("mrpc/train-00000-of-00001.parquet")).unwrap();
    std::fs::copy(&pairs, snapshot.join("cola/train-00000-of-00001.parquet")).unwrap();
    std::fs::copy(
        &pairs,
        snapshot.join("mrpc/validation-00000-of-00001.parquet"),
    )
    .unwrap();
}

fn config(tmp: &Path, dataset_config: &str) -> std::path::PathBuf {
    RunConfig::new(
        &fixtures().join("train_parity"),
        Path::new("hf://datasets/nyu-mll/glue"),
        &tmp.join(format!("run-{dataset_config}")),
    )
    .set("data.eval_file", "hf://datasets/nyu-mll/glue")
    .set("data.dataset_config", dataset_config)
    .set("data.text_column", "sentence1")
    .set("data.text_pair_column", "sentence2")
    .set("train.max_steps", 2)
    .set("train.batch_size", 4)
    .write(&tmp.join(format!("{dataset_config}.toml")))
}

#[test]
fn hub_data_sets_resolve_by_config_and_split_offline() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf");
    fake_cache(&home);
    let run = |c: &Path| {
        sprtrain()
            .arg("--config")
            .arg(c)
            .env("HF_HOME", &home)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let log = ok(run(&config(tmp.path(), "mrpc")));
    assert!(log.contains("5 examples (5 held for evaluation)"), "{log}");
    let r = common::eval_results(&tmp.path().join("run-mrpc"));
    assert!(r["eval_accuracy"].as_f64().is_some(), "{r}");

    // cola has no validation split; an unknown config lists the known ones.
    for (name, want) in [
        (
            "cola",
            "config \"cola\" has no split \"validation\" (it has train)",
        ),
        (
            "sst2",
            "no config \"sst2\" in the data set (it has cola, mrpc)",
        ),
    ] {
        let out = run(&config(tmp.path(), name));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains(want), "{stderr}");
    }
}
