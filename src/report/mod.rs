//! What a run shows and leaves behind: the JSON Lines metrics log, the progress bar (or log
//! lines when stderr is not a terminal), the final summary table, and a PNG plot of the loss
//! and evaluation metrics over steps.

pub mod tensorboard;

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
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

/// A progress bar on a terminal; plain log lines otherwise.
pub struct Progress {
    bar: Option<ProgressBar>,
    shown: bool,
}

impl Progress {
    /// `shown` is false on ranks other than 0: they show nothing.
    pub fn new(total: usize, done: usize, shown: bool) -> Self {
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = (shown && terminal).then(|| {
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  eta {eta}  {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_position(done as u64);
            bar
        });
        Progress { bar, shown }
    }

    /// One optimizer step done.
    pub fn step(&mut self, loss: f64, samples: usize) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            let per_s = samples as f64 * bar.per_sec();
            bar.set_message(format!("loss {loss:.4}  {per_s:.1} samples/s"));
        }
    }

    /// A logged record: above the bar, or as a log line.
    pub fn log(&self, record: &Value) {
        if !self.shown {
            return;
        }
        let line = summarize(record);
        match &self.bar {
            Some(bar) => bar.println(line),
            None => tracing::info!("{line}"),
        }
    }

    pub fn note(&self, text: &str) {
        if !self.shown {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(text),
            None => tracing::info!("{text}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `key value` pairs of a record in key order, numbers rounded for reading.
fn summarize(record: &Value) -> String {
    let Some(obj) = record.as_object() else {
        return record.to_string();
    };
    let mut pairs: Vec<(&String, &Value)> = obj.iter().collect();
    pairs.sort_by_key(|(k, _)| *k);
    pairs
        .into_iter()
        .map(|(k, v)| match v.as_f64() {
            Some(x) if k == "step" => format!("{k} {x}"),
            Some(x) if k == "lr" => format!("{k} {x:.3e}"),
            Some(x) => format!("{k} {x:.4}"),
            None => format!("{k} {v}"),
        })
        .collect::<Vec<_>>()
        .join("  ")
}

/// The plot's size in pixels: two 500 x 420 panels side by side.
const PLOT_SIZE: (u32, u32) = (1000, 420);

/// The plot's font, embedded so that no node needs fontconfig, FreeType or a system font
/// (DejaVu Sans; its licence is in assets/fonts/LICENSE).
static PLOT_FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// Makes the embedded font plotters' "sans-serif", once per process.
fn register_plot_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let registered = *REGISTERED.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, PLOT_FONT).is_ok()
    });
    anyhow::ensure!(registered, "the embedded plot font does not load");
    Ok(())
}

/// Two panels over steps: training loss, and every `eval_*` metric.
pub fn plot(path: &Path, history: &[Value]) -> Result<()> {
    let series = |key: &str| -> Vec<(f64, f64)> {
        history
            .iter()
            .filter_map(|r| Some((r.get("step")?.as_f64()?, r.get(key)?.as_f64()?)))
            .collect()
    };
    let mut eval_keys: Vec<String> = history
        .iter()
        .filter_map(|r| r.as_object())
        .flat_map(|o| o.keys().filter(|k| k.starts_with("eval_")).cloned())
        .collect();
    eval_keys.sort();
    eval_keys.dedup();
    let max_step = history
        .iter()
        .filter_map(|r| r.get("step")?.as_f64())
        .fold(1.0, f64::max);
    let loss = vec![("loss".to_string(), series("loss"))];
    let evals = eval_keys.iter().map(|k| (k.clone(), series(k))).collect();

    register_plot_font()?;
    // Drawn in memory, then written as a PNG atomically and durably like every kept file.
    let (width, height) = PLOT_SIZE;
    let mut pixels = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, PLOT_SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(width / 2);
        draw_panel(&left, "training loss", loss, max_step)?;
        draw_panel(&right, "evaluation", evals, max_step)?;
        root.present()
            .with_context(|| format!("cannot draw {}", path.display()))?;
    }
    crate::io::atomic_file::write_atomic_with(path, |tmp| {
        image::save_buffer_with_format(
            tmp,
            &pixels,
            width,
            height,
            image::ColorType::Rgb8,
            image::ImageFormat::Png,
        )
        .with_context(|| format!("cannot write {}", tmp.display()))
    })
}

/// One panel: each named series as markers joined by a line, over steps 0..`max_step`.
fn draw_panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    title: &str,
    lines: Vec<(String, Vec<(f64, f64)>)>,
    max_step: f64,
) -> Result<()> {
    let (lo, hi) = lines
        .iter()
        .flat_map(|(_, s)| s.iter().map(|p| p.1))
        .fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    let (lo, hi) = match (lo, hi) {
        (lo, hi) if lo > hi => (0.0, 1.0), // no points
        (lo, hi) if hi > lo => (lo, hi),
        (lo, hi) => (lo - 0.5, hi + 0.5),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..max_step, lo..hi)?;
    chart.configure_mesh().x_desc("step").draw()?;
    for (i, (name, points)) in lines.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        // Markers too: evaluations are often too few for a line to show.
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plot_writes_a_png_with_sparse_evaluations() {
        let history: Vec<Value> = (1..=20)
            .map(|s| serde_json::json!({"step": s * 10, "loss": 0.7 / (s as f64).sqrt()}))
            .chain([
                serde_json::json!({"step": 100, "eval_accuracy": 0.81, "eval_loss": 0.45}),
                serde_json::json!({"step": 200, "eval_accuracy": 0.86, "eval_loss": 0.38}),
            ])
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = std::env::var_os("SPRTRAIN_PLOT_OUT")
            .map(std::path::PathBuf::from)
            .unwrap_or(dir.path().join("t.png"));
        plot(&path, &history).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
    }

    #[test]
    fn summary_lines_round_numbers() {
        let line = summarize(&serde_json::json!({"step": 5, "lr": 0.00005, "loss": 0.123456}));
        assert_eq!(line, "loss 0.1235  lr 5.000e-5  step 5");
    }
}
