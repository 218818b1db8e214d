//! The PNG plot a run leaves: training loss, and every evaluation metric, over steps.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::Value;

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
}
