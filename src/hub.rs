//! Where files come from: a local path, or the Hugging Face Hub through hf-hub and the standard
//! cache (`$HF_HOME/hub`, default `~/.cache/huggingface/hub`). Models are a local directory or a
//! Hub id; data files are a local path or `hf://datasets/REPO[@REVISION]/PATH`.
//!
//! Offline (`HF_HUB_OFFLINE=1`) only the cache is read, as transformers does.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use std::collections::BTreeSet;

use crate::hf_files::{read_index, CONFIG_FILE, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILE};

/// Whether the user asked for no network access.
pub fn hub_offline() -> bool {
    matches!(
        std::env::var("HF_HUB_OFFLINE")
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Ok("1" | "true" | "yes" | "on")
    )
}

/// A spec names a local path when it exists, or is written like one (absolute, `./`, `../`,
/// `~`, or more than one `/`); otherwise it is a Hub id such as `distilbert-base-uncased` or
/// `org/name`.
fn looks_like_path(spec: &str) -> bool {
    spec.starts_with('/')
        || spec.starts_with('.')
        || spec.starts_with('~')
        || spec.matches('/').count() > 1
        || spec.contains('\\')
}

/// Returns the directory holding config.json, the weights and tokenizer.json.
pub fn resolve_model_dir(spec: &str, revision: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        bail!("model path {spec} is a file; expected a directory with {CONFIG_FILE}");
    }
    if looks_like_path(spec) {
        bail!("model directory {spec} does not exist");
    }
    let repo = Repo::with_revision(spec.to_string(), RepoType::Model, revision.to_string());
    if hub_offline() {
        from_cache(spec, revision, &repo, &Cache::from_env())
    } else {
        download(spec, revision, repo)
    }
}

/// The distinct shard files a sharded checkpoint's index names.
fn weight_files_from_index(index: &Path) -> Result<BTreeSet<String>> {
    Ok(read_index(index)?.into_values().collect())
}

fn from_cache(spec: &str, revision: &str, repo: &Repo, cache: &Cache) -> Result<PathBuf> {
    let cached = cache.repo(repo.clone());
    // A pinned commit has a snapshot directory of its own name and no ref file.
    let get = |file: &str| -> Option<PathBuf> {
        cached.get(file).or_else(|| {
            let p = cache
                .path()
                .join(repo.folder_name())
                .join("snapshots")
                .join(revision)
                .join(file);
            p.is_file().then_some(p)
        })
    };
    let missing = |file: &str| {
        anyhow::anyhow!(
            "{spec} (revision {revision}) has no {file} in the Hugging Face cache at {} and HF_HUB_OFFLINE is set; \
             run once online or pass a local model directory",
            cache.path().display()
        )
    };
    let config = get(CONFIG_FILE).ok_or_else(|| missing(CONFIG_FILE))?;
    get(TOKENIZER_FILE).ok_or_else(|| missing(TOKENIZER_FILE))?;
    if get(SINGLE_FILE).is_none() {
        let index = get(INDEX_FILE).ok_or_else(|| missing(SINGLE_FILE))?;
        for shard in weight_files_from_index(&index)? {
            get(&shard).ok_or_else(|| missing(&shard))?;
        }
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

fn download(spec: &str, revision: &str, repo: Repo) -> Result<PathBuf> {
    let api = ApiBuilder::from_env()
        .with_progress(false)
        .build()
        .context("cannot set up the Hugging Face Hub client")?;
    let api = api.repo(repo);
    let fetch = |file: &str| {
        api.get(file).with_context(|| {
            format!(
                "cannot download {file} of {spec} (revision {revision}) from the Hugging Face Hub; \
                 offline, set HF_HUB_OFFLINE=1 to use the cache, or pass a local model directory"
            )
        })
    };
    let config = fetch(CONFIG_FILE)?;
    fetch(TOKENIZER_FILE)?;
    if fetch(SINGLE_FILE).is_err() {
        let index = fetch(INDEX_FILE)
            .with_context(|| format!("{spec} has neither {SINGLE_FILE} nor {INDEX_FILE}"))?;
        for shard in weight_files_from_index(&index)? {
            fetch(&shard)?;
        }
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// A data file: a local path, or `hf://datasets/OWNER/NAME[@REVISION]/PATH` fetched into (or,
/// offline, read from) the HF cache.
pub fn resolve_data_file(spec: &str) -> Result<PathBuf> {
    let Some(rest) = spec.strip_prefix("hf://datasets/") else {
        return Ok(PathBuf::from(spec));
    };
    let mut parts = rest.splitn(3, '/');
    let (owner, name_rev, file) = match (parts.next(), parts.next(), parts.next()) {
        (Some(o), Some(n), Some(f)) if !o.is_empty() && !n.is_empty() && !f.is_empty() => (o, n, f),
        _ => bail!("{spec}: expected hf://datasets/OWNER/NAME[@REVISION]/PATH"),
    };
    let (name, revision) = name_rev.split_once('@').unwrap_or((name_rev, "main"));
    let repo_id = format!("{owner}/{name}");
    let repo = Repo::with_revision(repo_id.clone(), RepoType::Dataset, revision.to_string());
    if hub_offline() {
        let cache = Cache::from_env();
        return cache.repo(repo).get(file).with_context(|| {
            format!(
                "{spec}: not in the Hugging Face cache at {} and HF_HUB_OFFLINE is set",
                cache.path().display()
            )
        });
    }
    let api = ApiBuilder::from_env()
        .with_progress(false)
        .build()
        .context("cannot set up the Hugging Face Hub client")?;
    api.repo(repo).get(file).with_context(|| {
        format!("cannot download {spec} from the Hugging Face Hub; offline, set HF_HUB_OFFLINE=1 to use the cache, or use a local file")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_told_apart() {
        assert!(!looks_like_path("distilbert-base-uncased"));
        assert!(!looks_like_path("sentence-transformers/all-MiniLM-L6-v2"));
        assert!(looks_like_path("./model"));
        assert!(looks_like_path("/abs/model"));
        assert!(looks_like_path("runs/a/checkpoint-10"));
    }

    #[test]
    fn offline_cache_miss_names_the_model_and_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        std::env::set_var("HF_HOME", dir.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        let err = resolve_model_dir("distilbert-base-uncased", "main")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("distilbert-base-uncased") && err.contains("HF_HUB_OFFLINE"),
            "{err}"
        );
    }

    #[test]
    fn offline_cache_hit_returns_the_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let repo_dir = dir.path().join("hub").join("models--org--tiny");
        let snap = repo_dir.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs").join("main"), "abc123").unwrap();
        for f in [CONFIG_FILE, TOKENIZER_FILE, SINGLE_FILE] {
            std::fs::write(snap.join(f), "{}").unwrap();
        }
        let cache = Cache::new(dir.path().join("hub"));
        let repo = Repo::with_revision("org/tiny".into(), RepoType::Model, "main".into());
        assert_eq!(from_cache("org/tiny", "main", &repo, &cache).unwrap(), snap);
        let pinned = Repo::with_revision("org/tiny".into(), RepoType::Model, "abc123".into());
        assert_eq!(
            from_cache("org/tiny", "abc123", &pinned, &cache).unwrap(),
            snap
        );
        let other = Repo::with_revision("org/tiny".into(), RepoType::Model, "v2".into());
        assert!(from_cache("org/tiny", "v2", &other, &cache).is_err());
    }
}
