//! Which file of a Hub data set repository holds a config's split, decided from the
//! repository's file listing as the `datasets` library decides it: the dataset card's YAML
//! `configs:` (`config_name`, `data_files` with `split` and `path` patterns, `default`) when
//! it has them; otherwise the files under the config's directory (none for the default
//! config) whose path names the split between non-letters (`train`, `my_train-00000.parquet`,
//! `validation/0.parquet`; `dev`/`valid`/`val` for validation, `testing`/`eval` for test),
//! and every data file as `train` when no file names a split.

use anyhow::{bail, Context, Result};
use globset::{GlobBuilder, GlobSetBuilder};
use yaml_rust2::{Yaml, YamlLoader};

/// Extensions of the files sprtrain reads.
const DATA_EXTENSIONS: [&str; 7] = [
    ".parquet", ".csv", ".tsv", ".jsonl", ".json", ".txt", ".conll",
];

/// The names a split goes by in file names (`datasets`' split keywords).
fn split_keywords(split: &str) -> Vec<&str> {
    match split {
        "train" => vec!["train", "training"],
        "validation" => vec!["validation", "valid", "dev", "val"],
        "test" => vec!["test", "testing", "eval", "evaluation"],
        other => vec![other],
    }
}

/// Whether `path` names `keyword` as a directory or between non-letters in a file name.
fn names_keyword(path: &str, keyword: &str) -> bool {
    path.split('/').any(|segment| {
        segment
            .split(|c: char| !c.is_ascii_alphabetic())
            .any(|word| word.eq_ignore_ascii_case(keyword))
    })
}

fn is_data_file(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    DATA_EXTENSIONS.iter().any(|e| lower.ends_with(e))
}

/// One `configs:` entry of a dataset card: its name, whether it is the default, and its
/// (split, path patterns).
struct CardConfig {
    name: String,
    default: bool,
    data_files: Vec<(String, Vec<String>)>,
}

/// The `configs:` of a dataset card's YAML front matter (between the leading `---` lines).
fn card_configs(readme: &str) -> Result<Vec<CardConfig>> {
    let Some(front) = readme
        .strip_prefix("---")
        .and_then(|rest| rest.split_once("\n---"))
        .map(|(yaml, _)| yaml)
    else {
        return Ok(Vec::new());
    };
    let docs = YamlLoader::load_from_str(front).context("README.md: invalid YAML front matter")?;
    let Some(configs) = docs.first().and_then(|d| d["configs"].as_vec()) else {
        return Ok(Vec::new());
    };
    let strings = |y: &Yaml| -> Vec<String> {
        match y {
            Yaml::String(s) => vec![s.clone()],
            Yaml::Array(a) => a
                .iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect(),
            _ => Vec::new(),
        }
    };
    let mut out = Vec::new();
    for c in configs {
        let name = c["config_name"].as_str().unwrap_or("default").to_string();
        let files = &c["data_files"];
        let data_files = match files {
            // A pattern or a list of patterns: the train split.
            Yaml::String(_) => vec![("train".to_string(), strings(files))],
            Yaml::Array(entries) if entries.iter().all(|e| e.as_str().is_some()) => {
                vec![("train".to_string(), strings(files))]
            }
            Yaml::Array(entries) => entries
                .iter()
                .filter_map(|e| Some((e["split"].as_str()?.to_string(), strings(&e["path"]))))
                .collect(),
            Yaml::Hash(map) => map
                .iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_string(), strings(v))))
                .collect(),
            _ => Vec::new(),
        };
        out.push(CardConfig {
            default: c["default"].as_bool().unwrap_or(false),
            name,
            data_files,
        });
    }
    Ok(out)
}

/// The files of `config`'s `split` among `listing` (paths in the repository), given the
/// repository's README.md. `config` empty means the default one.
pub fn split_files(
    listing: &[String],
    readme: Option<&str>,
    config: &str,
    split: &str,
) -> Result<Vec<String>> {
    let configs = readme.map(card_configs).transpose()?.unwrap_or_default();
    let files: Vec<&String> = listing.iter().filter(|f| is_data_file(f)).collect();
    if configs.is_empty() {
        directory_split_files(files, config, split)
    } else {
        card_split_files(&configs, files, config, split)
    }
}

/// The config named (or, unnamed, the card's default or only one).
fn choose_config<'c>(configs: &'c [CardConfig], config: &str) -> Result<&'c CardConfig> {
    let names: Vec<&str> = configs.iter().map(|c| c.name.as_str()).collect();
    if config.is_empty() {
        configs
            .iter()
            .find(|c| c.default)
            .or_else(|| configs.iter().find(|c| c.name == "default"))
            .or_else(|| (configs.len() == 1).then(|| &configs[0]))
            .with_context(|| {
                format!(
                    "the data set has several configs: choose one with data.dataset_config ({})",
                    names.join(", ")
                )
            })
    } else {
        configs.iter().find(|c| c.name == config).with_context(|| {
            format!(
                "no config {config:?} in the data set (it has {})",
                names.join(", ")
            )
        })
    }
}

/// The files the card's `configs` give the split, by their glob patterns.
fn card_split_files(
    configs: &[CardConfig],
    files: Vec<&String>,
    config: &str,
    split: &str,
) -> Result<Vec<String>> {
    let chosen = choose_config(configs, config)?;
    let Some((_, patterns)) = chosen.data_files.iter().find(|(s, _)| s == split) else {
        bail!(
            "config {:?} has no split {split:?} (it has {})",
            chosen.name,
            chosen
                .data_files
                .iter()
                .map(|(s, _)| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let mut set = GlobSetBuilder::new();
    for p in patterns {
        set.add(
            GlobBuilder::new(p)
                .literal_separator(true)
                .build()
                .with_context(|| format!("data_files pattern {p:?}"))?,
        );
    }
    let set = set.build()?;
    Ok(files
        .into_iter()
        .filter(|f| set.is_match(f.as_str()))
        .cloned()
        .collect())
}

/// Without card configs: a config is a directory of the repository, and a split is the files
/// whose names say it (all files are the train split where no name says any split).
fn directory_split_files(files: Vec<&String>, config: &str, split: &str) -> Result<Vec<String>> {
    let in_config: Vec<&String> = match config {
        "" | "default" => files,
        c => {
            let prefix = format!("{c}/");
            let under: Vec<&String> = files
                .into_iter()
                .filter(|f| f.starts_with(&prefix))
                .collect();
            if under.is_empty() {
                bail!("no data files under {prefix} for config {c:?}");
            }
            under
        }
    };
    let named = |f: &str, s: &str| split_keywords(s).iter().any(|k| names_keyword(f, k));
    let standard = ["train", "validation", "test"];
    let any_named = in_config
        .iter()
        .any(|f| standard.iter().chain([&split]).any(|s| named(f, s)));
    if !any_named {
        return Ok(if split == "train" {
            in_config.into_iter().cloned().collect()
        } else {
            Vec::new()
        });
    }
    Ok(in_config
        .into_iter()
        .filter(|f| named(f, split))
        .cloned()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(files: &[&str]) -> Vec<String> {
        files.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn card_configs_pick_the_patterns() {
        let readme = "---\nlicense: other\nconfigs:\n- config_name: cola\n  data_files:\n  - split: train\n    path: cola/train-*\n- config_name: mrpc\n  data_files:\n  - split: train\n    path: mrpc/train-*\n  - split: validation\n    path: mrpc/validation-*\n---\n# GLUE\n";
        let files = list(&[
            "README.md",
            "cola/train-00000-of-00001.parquet",
            "mrpc/train-00000-of-00001.parquet",
            "mrpc/validation-00000-of-00001.parquet",
            "mrpc/test-00000-of-00001.parquet",
        ]);
        assert_eq!(
            split_files(&files, Some(readme), "mrpc", "validation").unwrap(),
            ["mrpc/validation-00000-of-00001.parquet"]
        );
        let e = split_files(&files, Some(readme), "", "train").unwrap_err();
        assert!(format!("{e:#}").contains("choose one with data.dataset_config (cola, mrpc)"));
        let e = split_files(&files, Some(readme), "sst2", "train").unwrap_err();
        assert!(format!("{e:#}").contains("no config \"sst2\""));
        let e = split_files(&files, Some(readme), "cola", "test").unwrap_err();
        assert!(format!("{e:#}").contains("has no split \"test\" (it has train)"));
    }

    #[test]
    fn file_names_name_the_splits() {
        let files = list(&[
            "README.md",
            "data/train-00000-of-00001.parquet",
            "data/dev_set.csv",
            "data/testing.jsonl",
        ]);
        assert_eq!(
            split_files(&files, None, "", "validation").unwrap(),
            ["data/dev_set.csv"]
        );
        assert_eq!(
            split_files(&files, None, "", "test").unwrap(),
            ["data/testing.jsonl"]
        );
        // "contest" does not name "test": split names stand between non-letters.
        let files = list(&["contest.csv"]);
        assert_eq!(
            split_files(&files, None, "", "train").unwrap(),
            ["contest.csv"]
        );
        assert!(split_files(&files, None, "", "test").unwrap().is_empty());
        // Config directories without a card, as the Hub's parquet conversion lays them out.
        let files = list(&[
            "plain_text/train/0000.parquet",
            "plain_text/validation/0000.parquet",
        ]);
        assert_eq!(
            split_files(&files, None, "plain_text", "validation").unwrap(),
            ["plain_text/validation/0000.parquet"]
        );
    }
}
