//! Where files come from: a local path, or the Hugging Face Hub through hf-hub and the standard
//! cache (`$HF_HOME/hub`, default `~/.cache/huggingface/hub`). Models are a local directory or a
//! Hub id; data files are a local path or `hf://datasets/REPO[@REVISION]/PATH`.
//!
//! Offline (`HF_HUB_OFFLINE=1`) only the cache is read, as transformers does.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};

use crate::io::hf_files::{
    read_index, CONFIG_FILE, INDEX_FILE, PICKLE_FILE, SINGLE_FILE, TOKENIZER_FILE,
};

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

/// A Hub repository id, revision or file path must stay inside the cache directory: no empty,
/// `.` or `..` parts, no leading `/`, no backslash.
fn check_hub_name(what: &str, name: &str) -> Result<()> {
    if name.starts_with('/')
        || name.contains('\\')
        || name
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        bail!(
            "{what} {name:?} is not a valid Hugging Face Hub name (no empty, \".\" or \"..\" parts, no leading \"/\")"
        );
    }
    Ok(())
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
    check_hub_name("model id", spec)?;
    check_hub_name("model revision", revision)?;
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
        if get(INDEX_FILE).is_none() && get(PICKLE_FILE).is_some() {
            let files = BTreeSet::from([PICKLE_FILE.to_string()]);
            weight_files(spec, &files)?;
        }
        let index = get(INDEX_FILE).ok_or_else(|| missing(SINGLE_FILE))?;
        for shard in weight_files_from_index(&index)? {
            get(&shard).ok_or_else(|| missing(&shard))?;
        }
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// The Hub client: endpoint and cache from the environment (HF_ENDPOINT, HF_HOME), the token
/// from HF_TOKEN or else the cache's token file, as huggingface_hub takes them. The token is
/// only ever sent to the Hub, never logged.
fn hub_client() -> Result<hf_hub::api::sync::Api> {
    let mut builder = ApiBuilder::from_env().with_progress(false);
    if let Some(token) = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        builder = builder.with_token(Some(token.trim().to_string()));
    }
    builder
        .build()
        .context("cannot set up the Hugging Face Hub client")
}

/// The weights a model repository holds, as its file listing shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightFiles {
    /// model.safetensors.
    Single,
    /// model.safetensors.index.json and the shards it names.
    Sharded,
}

/// Which weights to fetch, decided from the repository's file listing: model.safetensors, else
/// the sharded index; a repository with only PyTorch pickles (or none) is refused with what to
/// do.
pub fn weight_files(spec: &str, files: &BTreeSet<String>) -> Result<WeightFiles> {
    if files.contains(SINGLE_FILE) {
        return Ok(WeightFiles::Single);
    }
    if files.contains(INDEX_FILE) {
        return Ok(WeightFiles::Sharded);
    }
    let pickles: Vec<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| *f == PICKLE_FILE || (f.starts_with("pytorch_model-") && f.ends_with(".bin")))
        .collect();
    if pickles.is_empty() {
        bail!("{spec} has no model weights ({SINGLE_FILE} or {INDEX_FILE})");
    }
    bail!(
        "{spec} has no safetensors weights, only {}: sprtrain reads safetensors; convert them with \
         transformers (`AutoModel.from_pretrained(...).save_pretrained(dir)` writes safetensors) \
         and pass that directory",
        pickles.join(", ")
    )
}

/// A failed Hub request said as what it is: the network, the token, or a missing repository,
/// revision or file.
fn hub_error(
    e: hf_hub::api::sync::ApiError,
    spec: &str,
    revision: &str,
    what: &str,
) -> anyhow::Error {
    use hf_hub::api::sync::ApiError;
    let ApiError::RequestError(request) = e else {
        return anyhow::anyhow!("cannot download {what} of {spec} (revision {revision}): {e}");
    };
    match *request {
        ureq::Error::Status(401 | 403, _) => anyhow::anyhow!(
            "the Hugging Face Hub refused {what} of {spec}: the repository is private or gated, \
             or HF_TOKEN is missing or has no access to it (set HF_TOKEN to a token that does)"
        ),
        ureq::Error::Status(404, _) if what == LISTING => anyhow::anyhow!(
            "{spec} (revision {revision}) is not on the Hugging Face Hub: no such repository, \
             or no such branch, tag or commit"
        ),
        ureq::Error::Status(404, _) => {
            anyhow::anyhow!(
                "{spec} (revision {revision}) has no file {what} on the Hugging Face Hub"
            )
        }
        ureq::Error::Status(code, _) => anyhow::anyhow!(
            "the Hugging Face Hub answered HTTP {code} for {what} of {spec} (revision {revision})"
        ),
        ureq::Error::Transport(t) => anyhow::anyhow!(
            "cannot reach the Hugging Face Hub for {spec} ({t}); offline, set HF_HUB_OFFLINE=1 to \
             use the cache, or pass a local model directory"
        ),
    }
}

/// What [`hub_error`] calls the repository's file listing.
const LISTING: &str = "the file listing";

fn download(spec: &str, revision: &str, repo: Repo) -> Result<PathBuf> {
    let api = hub_client()?.repo(repo);
    let listing = api
        .info()
        .map_err(|e| hub_error(e, spec, revision, LISTING))?;
    let files: BTreeSet<String> = listing.siblings.into_iter().map(|s| s.rfilename).collect();
    for required in [CONFIG_FILE, TOKENIZER_FILE] {
        if !files.contains(required) {
            bail!("{spec} (revision {revision}) has no {required} on the Hugging Face Hub");
        }
    }
    let weights = weight_files(spec, &files)?;
    let fetch = |file: &str| {
        api.get(file)
            .map_err(|e| hub_error(e, spec, revision, file))
    };
    let config = fetch(CONFIG_FILE)?;
    fetch(TOKENIZER_FILE)?;
    match weights {
        WeightFiles::Single => {
            fetch(SINGLE_FILE)?;
        }
        WeightFiles::Sharded => {
            for shard in weight_files_from_index(&fetch(INDEX_FILE)?)? {
                fetch(&shard)?;
            }
        }
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// Which part of a Hub data set a bare `hf://datasets/OWNER/NAME` names.
#[derive(Debug, Clone, Copy)]
pub struct SplitChoice<'a> {
    /// The config (`data.dataset_config`); empty for the default one.
    pub config: &'a str,
    pub split: &'a str,
}

/// A data file: a local path; `hf://datasets/OWNER/NAME[@REVISION]/PATH`; or
/// `hf://datasets/OWNER/NAME[@REVISION]`, the file of `choice`'s config and split in the
/// repository (see `dataset_repo`). Hub files are fetched into (or, offline, read from) the
/// HF cache.
pub fn resolve_data_file(spec: &str, choice: SplitChoice) -> Result<PathBuf> {
    let Some(rest) = spec.strip_prefix("hf://datasets/") else {
        return Ok(PathBuf::from(spec));
    };
    let mut parts = rest.splitn(3, '/');
    let (owner, name_rev, file) = match (parts.next(), parts.next(), parts.next()) {
        (Some(o), Some(n), f) if !o.is_empty() && !n.is_empty() => (o, n, f.unwrap_or("")),
        _ => bail!("{spec}: expected hf://datasets/OWNER/NAME[@REVISION][/PATH]"),
    };
    let (name, revision) = name_rev.split_once('@').unwrap_or((name_rev, "main"));
    let repo_id = format!("{owner}/{name}");
    check_hub_name("data set", &repo_id).with_context(|| spec.to_string())?;
    check_hub_name("revision", revision).with_context(|| spec.to_string())?;
    if !file.is_empty() {
        check_hub_name("file", file).with_context(|| spec.to_string())?;
    }
    let repo = Repo::with_revision(repo_id.clone(), RepoType::Dataset, revision.to_string());
    let source = DatasetSource::new(repo)?;
    let file = if file.is_empty() {
        let listing = source.listing()?;
        let readme = listing
            .iter()
            .any(|f| f == "README.md")
            .then(|| source.get("README.md"))
            .transpose()?
            .map(|p| std::fs::read_to_string(&p).unwrap_or_default());
        let found = crate::io::dataset_repo::split_files(
            &listing,
            readme.as_deref(),
            choice.config,
            choice.split,
        )
        .with_context(|| spec.to_string())?;
        match found.as_slice() {
            [one] => one.clone(),
            [] => bail!(
                "{spec}: no file of split {:?} (config {:?})",
                choice.split,
                choice.config
            ),
            many => bail!(
                "{spec}: split {:?} is {} files ({}); sprtrain reads one file per split: name it as hf://datasets/{repo_id}/PATH",
                choice.split,
                many.len(),
                many.join(", ")
            ),
        }
    } else {
        file.to_string()
    };
    source.get(&file).with_context(|| spec.to_string())
}

/// A data set repository: the Hub, or offline the cache's snapshot of the revision.
enum DatasetSource {
    Hub(hf_hub::api::sync::ApiRepo),
    Cache { cache: Cache, repo: Repo },
}

impl DatasetSource {
    fn new(repo: Repo) -> Result<Self> {
        if hub_offline() {
            return Ok(DatasetSource::Cache {
                cache: Cache::from_env(),
                repo,
            });
        }
        Ok(DatasetSource::Hub(hub_client()?.repo(repo)))
    }

    /// Every file path of the repository at the revision.
    fn listing(&self) -> Result<Vec<String>> {
        match self {
            DatasetSource::Hub(api) => Ok(api
                .info()
                .context("cannot list the data set's files on the Hugging Face Hub; offline, set HF_HUB_OFFLINE=1 to use the cache")?
                .siblings
                .into_iter()
                .map(|s| s.rfilename)
                .collect()),
            DatasetSource::Cache { cache, repo } => {
                let root = cache.path().join(repo.folder_name());
                let revision = repo.revision();
                let commit = std::fs::read_to_string(root.join("refs").join(revision))
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| revision.to_string());
                let snapshot = root.join("snapshots").join(&commit);
                if !snapshot.is_dir() {
                    bail!(
                        "not in the Hugging Face cache at {} (no snapshot of revision {revision}) and HF_HUB_OFFLINE is set",
                        cache.path().display()
                    );
                }
                let mut files = Vec::new();
                list_dir(&snapshot, &snapshot, &mut files)?;
                files.sort();
                Ok(files)
            }
        }
    }

    fn get(&self, file: &str) -> Result<PathBuf> {
        match self {
            DatasetSource::Hub(api) => api.get(file).with_context(|| {
                format!("cannot download {file} from the Hugging Face Hub; offline, set HF_HUB_OFFLINE=1 to use the cache, or use a local file")
            }),
            DatasetSource::Cache { cache, repo } => cache.repo(repo.clone()).get(file).with_context(|| {
                format!(
                    "{file}: not in the Hugging Face cache at {} and HF_HUB_OFFLINE is set",
                    cache.path().display()
                )
            }),
        }
    }
}

/// The files under `dir`, as paths relative to `root` with `/` separators.
fn list_dir(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            list_dir(root, &path, out)?;
        } else if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(())
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
    fn weights_are_chosen_from_the_listing() {
        let files = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        let both = files(&[CONFIG_FILE, SINGLE_FILE, INDEX_FILE, PICKLE_FILE]);
        assert_eq!(weight_files("a/b", &both).unwrap(), WeightFiles::Single);
        let sharded = files(&[INDEX_FILE, "model-00001-of-00002.safetensors", PICKLE_FILE]);
        assert_eq!(weight_files("a/b", &sharded).unwrap(), WeightFiles::Sharded);
        let pickles = files(&[
            CONFIG_FILE,
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model-00002-of-00002.bin",
            "pytorch_model.bin.index.json",
        ]);
        let err = weight_files("a/b", &pickles).unwrap_err().to_string();
        assert!(
            err.starts_with("a/b has no safetensors weights, only pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin:")
                && err.contains("save_pretrained"),
            "{err}"
        );
        let err = weight_files("a/b", &files(&[CONFIG_FILE]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "a/b has no model weights (model.safetensors or model.safetensors.index.json)"
        );
    }

    #[test]
    fn hub_failures_say_what_they_are() {
        use hf_hub::api::sync::ApiError;
        let status = |code: u16| {
            let response = ureq::Response::new(code, "status", "").unwrap();
            ApiError::RequestError(Box::new(ureq::Error::Status(code, response)))
        };
        let say = |e, what| hub_error(e, "org/m", "v2", what).to_string();
        assert!(say(status(401), LISTING).contains("HF_TOKEN"));
        assert!(say(status(403), "config.json").contains("private or gated"));
        assert_eq!(
            say(status(404), LISTING),
            "org/m (revision v2) is not on the Hugging Face Hub: no such repository, or no such branch, tag or commit"
        );
        assert_eq!(
            say(status(404), "tokenizer.json"),
            "org/m (revision v2) has no file tokenizer.json on the Hugging Face Hub"
        );
        assert!(say(status(503), LISTING).contains("HTTP 503"));
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
