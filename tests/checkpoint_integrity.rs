//! Checkpoints that survive a power cut: every kept file is synced before the rename that
//! publishes it and its directory after; a resume verifies the checkpoint's manifest, passes
//! over a damaged newest checkpoint for the one before it, and refuses a damaged or
//! newer-format checkpoint named on the command line with one line, losing nothing.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{
    ok, require, sprtrain, tiny_classifier_data, tiny_classifier_run, weight_values, RunConfig,
};

fn write(dir: &Path, out: &Path, config: RunConfig) -> PathBuf {
    let name = out.file_name().unwrap().to_string_lossy().to_string();
    config.write(&dir.join(format!("{name}.toml")))
}

/// The 8-step run (checkpoints at 4 and 8) in `dir`/`name`; returns its output directory.
fn trained(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    let config = write(
        dir,
        &out,
        tiny_classifier_run(&tiny_classifier_data(dir), &out),
    );
    ok(sprtrain()
        .args(["--config", config.to_str().unwrap()])
        .output()
        .unwrap());
    out
}

fn resume(dir: &Path, out: &Path, spec: &str) -> std::process::Output {
    let config = write(dir, out, tiny_classifier_run(&dir.join("train.tsv"), out));
    sprtrain()
        .args(["--config", config.to_str().unwrap(), "--resume", spec])
        .output()
        .unwrap()
}

/// Every file under `dir` with its contents, to show that a refused run changed nothing.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

/// A refused run: exit 1, one line on stderr starting `sprtrain: error: `, no panic.
fn one_line_failure(out: std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("sprtrain: error: "))
        .collect();
    assert_eq!(errors.len(), 1, "one error line: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    errors[0].to_string()
}

/// A newest checkpoint whose weights were cut to 0 bytes (as a power cut can leave an unsynced
/// file) is passed over with a line naming the file; the run resumes from the checkpoint
/// before it and ends with the uninterrupted run's weights, bitwise.
#[test]
fn resume_latest_passes_over_a_damaged_newest_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let full = trained(tmp.path(), "full");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(full.join("checkpoint-8").join("manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["format"], 2, "{manifest}");

    // A run that stopped after its save of step 8, which then lost its weights.
    let part = tmp.path().join("part");
    for step in [4, 8] {
        let to = part.join(format!("checkpoint-{step}"));
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(full.join(format!("checkpoint-{step}"))).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    let damaged = part.join("checkpoint-8").join("model.safetensors");
    std::fs::write(&damaged, b"").unwrap();
    let text = ok(resume(tmp.path(), &part, "latest"));
    let passed = text
        .lines()
        .find(|l| l.contains("passing over"))
        .unwrap_or_else(|| panic!("no line about the damaged checkpoint: {text}"));
    assert!(
        passed.contains(&format!(
            "{} has 0 bytes, the manifest says",
            damaged.display()
        )),
        "{passed}"
    );
    assert!(
        text.contains(&format!(
            "resumed from {}",
            part.join("checkpoint-4").display()
        )) && text.contains("at step 4"),
        "{text}"
    );
    assert_eq!(weight_values(&part), weight_values(&full));
    // The re-save of step 8 replaced the damaged checkpoint with an intact one.
    assert_eq!(
        weight_values(&part.join("checkpoint-8")),
        weight_values(&full)
    );
}

/// `--resume DIR` naming a damaged checkpoint (one flipped byte), or `--resume latest` when
/// the newest checkpoint is of a newer format, is refused with one line, and nothing in the
/// output directory changes.
#[test]
fn damaged_or_newer_checkpoints_are_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = trained(tmp.path(), "out");
    let optimizer = out.join("checkpoint-4").join("optimizer.safetensors");
    let mut bytes = std::fs::read(&optimizer).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x20;
    std::fs::write(&optimizer, bytes).unwrap();
    let before = snapshot(&out);
    let dir = out.join("checkpoint-4");
    let line = one_line_failure(resume(tmp.path(), &out, dir.to_str().unwrap()));
    assert!(
        line.contains("the checkpoint is damaged")
            && line.contains(&format!(
                "{} does not match its checksum",
                optimizer.display()
            )),
        "{line}"
    );
    assert!(before == snapshot(&out), "a refused resume changed files");

    // The newest checkpoint written by a newer sprtrain: refused, not passed over (resuming
    // an older one would overwrite it).
    let newest = out.join("checkpoint-8");
    for name in ["manifest.json", "trainer_state.json"] {
        let path = newest.join(name);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v["format"] = 3.into();
        std::fs::write(&path, v.to_string()).unwrap();
    }
    let before = snapshot(&out);
    let line = one_line_failure(resume(tmp.path(), &out, "latest"));
    assert!(
        line.contains("checkpoint format 3 by a newer sprtrain")
            && line.contains("this one reads formats 1-2"),
        "{line}"
    );
    assert!(before == snapshot(&out), "a refused resume changed files");
}

/// A checkpoint resumed under a config naming another model (here one layer more) is refused
/// with one line naming the key that differs, instead of training the checkpoint's model
/// under a config that says otherwise; nothing in the output directory changes.
#[test]
fn a_checkpoint_of_another_model_is_refused_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = trained(tmp.path(), "out");
    let other = tmp.path().join("other-model");
    std::fs::create_dir(&other).unwrap();
    for entry in std::fs::read_dir(common::tiny_classifier()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.join(path.file_name().unwrap())).unwrap();
    }
    let config_json = other.join("config.json");
    let mut hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_json).unwrap()).unwrap();
    let layers = hf["num_hidden_layers"].as_i64().unwrap();
    hf["num_hidden_layers"] = (layers + 1).into();
    std::fs::write(&config_json, hf.to_string()).unwrap();
    let before = snapshot(&out);
    let run = RunConfig::new(&other, &tmp.path().join("train.tsv"), &out);
    let config = write(tmp.path(), &out, run);
    let refused = sprtrain()
        .args(["--config", config.to_str().unwrap(), "--resume", "latest"])
        .output()
        .unwrap();
    let line = one_line_failure(refused);
    let want = format!(
        "the checkpoint holds another model than model.name_or_path = {} (num_hidden_layers {layers} there, {} here)",
        other.display(),
        layers + 1
    );
    assert!(line.contains(&want), "{line}");
    assert!(before == snapshot(&out), "a refused resume changed files");
}

/// What a save does, traced with strace: each file published into a checkpoint, the final
/// model and the plot is synced (fsync/fdatasync on a descriptor of its temporary name) before
/// the rename that publishes it, the directory it lands in is synced after that rename, and
/// the same for the checkpoint directory's own rename into the output directory.
#[test]
fn every_published_file_is_synced_before_its_rename_and_its_directory_after() {
    let Some(strace) = require(
        std::process::Command::new("strace")
            .arg("-V")
            .output()
            .ok()
            .filter(|o| o.status.success()),
        "no strace (scripts/setup.sh installs it)",
    ) else {
        return;
    };
    drop(strace);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let config = write(
        tmp.path(),
        &out,
        tiny_classifier_run(&tiny_classifier_data(tmp.path()), &out)
            .set("train.max_steps", 4)
            .set("train.save_steps", 2)
            .set("train.save_total_limit", 1),
    );
    let trace = tmp.path().join("strace.log");
    ok(std::process::Command::new("strace")
        .args([
            "-f",
            "-y",
            "-qq",
            "-e",
            "trace=fsync,fdatasync,rename,renameat,renameat2",
        ])
        .arg("-o")
        .arg(&trace)
        .arg(env!("CARGO_BIN_EXE_sprtrain"))
        .args(["--config", config.to_str().unwrap()])
        .output()
        .unwrap());
    let log = std::fs::read_to_string(&trace).unwrap();
    let published = check_sync_order(&log, &out);
    // model.safetensors, config.json, tokenizer.json, sprtrain.toml, optimizer.safetensors,
    // trainer_state.json, manifest.json in each of two checkpoints and (less the last three)
    // the final model; the plot, two checkpoint directories, a rotated one moved aside.
    let names: Vec<String> = published
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
        .collect();
    for name in [
        "manifest.json",
        "model.safetensors",
        "training.png",
        "checkpoint-2",
    ] {
        assert!(
            names.iter().any(|n| n == name),
            "{name} not published: {names:?}"
        );
    }
    assert!(published.len() >= 20, "{published:?}");
}

/// The paths in the `<...>` annotations strace -y puts after descriptors.
fn annotated_paths(line: &str) -> Vec<PathBuf> {
    line.split('<')
        .skip(1)
        .filter_map(|s| s.split('>').next())
        .map(PathBuf::from)
        .collect()
}

/// The quoted paths of a rename call: (from, to), resolved against the descriptors'
/// directories where renameat gives them.
fn rename_paths(line: &str) -> Option<(PathBuf, PathBuf)> {
    let quoted: Vec<&str> = line.split('"').skip(1).step_by(2).collect();
    let (from, to) = (quoted.first()?, quoted.get(1)?);
    let dirs = annotated_paths(line);
    let resolve = |p: &str, i: usize| match dirs.get(i) {
        Some(d) if !p.starts_with('/') => d.join(p),
        _ => PathBuf::from(p),
    };
    Some((resolve(from, 0), resolve(to, 1)))
}

/// Checks the order in an strace log and returns every path published under `out`: a path
/// renamed there was synced before, and its directory is synced after (before the process's
/// next rename into that directory's parent or the end of the log).
fn check_sync_order(log: &str, out: &Path) -> Vec<PathBuf> {
    let lines: Vec<&str> = log.lines().collect();
    let synced_at = |path: &Path, range: std::ops::Range<usize>| {
        range.into_iter().any(|i| {
            let l = lines[i];
            (l.contains("fsync(") || l.contains("fdatasync("))
                && annotated_paths(l).iter().any(|p| p == path)
        })
    };
    let mut published = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if !line.contains("rename") || line.contains("= -1") {
            continue;
        }
        let Some((from, to)) = rename_paths(line) else {
            continue;
        };
        if !to.starts_with(out) {
            continue;
        }
        // A directory moved aside for removal needs no sync of its own.
        let removal = to.file_name().unwrap().to_string_lossy().ends_with(".old");
        if !removal {
            // A directory is synced by the renames that filled it; a file by its own sync.
            assert!(
                synced_at(&from, 0..i),
                "{} renamed before it was synced",
                from.display()
            );
        }
        let dir = to.parent().unwrap();
        assert!(
            synced_at(dir, i + 1..lines.len()),
            "{}: its directory {} was not synced after the rename",
            to.display(),
            dir.display()
        );
        published.push(to);
    }
    published
}
