//! What a run shows and leaves behind: the JSON Lines metrics log, the progress bar (or log
//! lines when stderr is not a terminal), the final summary table, and a PNG plot of the loss
//! and evaluation metrics over steps.

pub mod plot;
pub mod progress;
pub mod tensorboard;

pub use plot::plot;
pub use progress::Progress;

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

/// Appends one JSON object per line and flushes it, so a killed run keeps its history.
pub struct MetricsLog {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl MetricsLog {
    /// Opens the log; a resumed run appends, a new run starts it afresh.
    pub fn open(path: &Path, append: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .with_context(|| format!("cannot open metrics log {}", path.display()))?;
        Ok(MetricsLog {
            file,
            path: path.to_path_buf(),
        })
    }

    pub fn write(&mut self, record: &Value) -> Result<()> {
        writeln!(self.file, "{record}")
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// Flushes the records so far to the disk (at each checkpoint and at the end of the run,
    /// so a power cut keeps the history the checkpoint continues from).
    pub fn sync(&self) -> Result<()> {
        self.file
            .sync_data()
            .with_context(|| format!("cannot sync {} to disk", self.path.display()))
    }
}

/// The end-of-run table.
pub fn summary_table(rows: &[(String, String)]) -> String {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut s = String::new();
    for (k, v) in rows {
        s.push_str(&format!("  {k:<width$}  {v}\n"));
    }
    s
}
