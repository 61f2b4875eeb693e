//! Training curves at the end of a run: the training loss and evaluation loss against the optimizer step (left
//! panel) and the other evaluation metrics (right panel), written as `training_curves.png` and
//! `training_curves.svg` with plotters.
//!
//! Text needs a TrueType font (plotters' `ab_glyph` backend loads none by itself): the first of `$ACCEL_PLOT_FONT`
//! and a few usual system paths (DejaVu Sans, Liberation Sans, ...) is used; without one the curves are drawn
//! without text and a warning says so.
//!
//! The loss panel switches to a log axis by itself when the losses span more than two decades (max / min > 100,
//! all positive), where a linear axis would flatten the rest of the run; its title then says "(log scale)". The best
//! checkpoint's step (`TrainerState::best_global_step`) is marked on both panels by a dashed vertical line, labelled
//! "best checkpoint (step N)".

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{Result, TrainerError};
use crate::state::TrainerState;

/// File stem of the plots in `output_dir`.
pub const PLOT_STEM: &str = "training_curves";

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a system font with plotters once per process; returns whether text can be drawn.
pub(crate) fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let env = std::env::var("ACCEL_PLOT_FONT").ok();
        let candidates = env.iter().map(String::as_str).chain(FONT_CANDIDATES.iter().copied());
        for path in candidates {
            if let Ok(bytes) = std::fs::read(path) {
                // Fonts live for the whole process: plotters wants &'static bytes.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        tracing::warn!(
            "no TrueType font found for plot labels (set ACCEL_PLOT_FONT to a .ttf file); drawing curves without text"
        );
        false
    })
}

/// One curve: name and (step, value) points.
type Series = (String, Vec<(f64, f64)>);

fn collect(state: &TrainerState) -> (Vec<Series>, Vec<Series>) {
    let to_f = |v: Vec<(u64, f64)>| v.into_iter().map(|(s, y)| (s as f64, y)).filter(|p| p.1.is_finite()).collect();
    let mut losses: Vec<Series> = Vec::new();
    for key in ["loss", "eval_loss"] {
        let pts: Vec<(f64, f64)> = to_f(state.series(key));
        if !pts.is_empty() {
            losses.push((if key == "loss" { "train loss".into() } else { key.to_string() }, pts));
        }
    }
    let mut names: Vec<String> = state
        .log_history
        .iter()
        .flat_map(|e| e.values.keys().cloned())
        .filter(|k| {
            k.starts_with("eval_")
                && k != "eval_loss"
                && !k.contains("runtime")
                && !k.contains("per_second")
                && !k.ends_with("perplexity")
        })
        .collect();
    names.sort();
    names.dedup();
    let metrics = names
        .into_iter()
        .map(|k| {
            let pts = to_f(state.series(&k));
            (k, pts)
        })
        .filter(|(_, p): &Series| !p.is_empty())
        .collect();
    (losses, metrics)
}

/// Writes `output_dir/training_curves.{png,svg}` from `state.log_history`; returns the files written (none when
/// nothing was logged).
pub fn plot_training_curves(state: &TrainerState, output_dir: &Path) -> Result<Vec<PathBuf>> {
    let (losses, metrics) = collect(state);
    if losses.is_empty() && metrics.is_empty() {
        return Ok(Vec::new());
    }
    let text = font_available();
    let panels: Vec<(&str, &[Series])> = [("loss", losses.as_slice()), ("evaluation metrics", metrics.as_slice())]
        .into_iter()
        .filter(|(_, s)| !s.is_empty())
        .collect();
    let size = (560 * panels.len() as u32, 420);
    let png = output_dir.join(format!("{PLOT_STEM}.png"));
    let svg = output_dir.join(format!("{PLOT_STEM}.svg"));
    let best = state.best_global_step;
    draw(BitMapBackend::new(&png, size).into_drawing_area(), &panels, text, best)
        .map_err(|reason| TrainerError::Plot { path: png.clone(), reason })?;
    draw(SVGBackend::new(&svg, size).into_drawing_area(), &panels, text, best)
        .map_err(|reason| TrainerError::Plot { path: svg.clone(), reason })?;
    Ok(vec![png, svg])
}

fn step_label(x: &f64) -> String {
    format!("{x:.0}")
}

/// Whether a loss panel is drawn on a log axis: automatically, when every value is positive and they span more than
/// two decades (max / min > 100) — a linear axis would flatten everything after the first steps into one line.
pub(crate) fn use_log_scale(series: &[Series]) -> bool {
    let (lo, hi) = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| (lo.min(y), hi.max(y)));
    lo > 0.0 && hi.is_finite() && hi / lo > 100.0
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[(&str, &[Series])],
    text: bool,
    best_step: Option<u64>,
) -> std::result::Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, (title, series)) in areas.iter().zip(panels) {
        let x_max = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(1.0f64, f64::max);
        let (mut y_min, mut y_max) = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| (lo.min(y), hi.max(y)));
        let best = best_step.map(|s| s as f64).filter(|&s| s <= x_max);
        if *title == "loss" && use_log_scale(series) {
            // A 10 % margin in log space on both sides.
            let (lo, hi) = (y_min / 1.25, y_max * 1.25);
            draw_panel(
                area,
                &format!("{title} (log scale)"),
                series,
                text,
                x_max,
                (lo..hi).log_scale(),
                (lo, hi),
                best,
            )?;
        } else {
            if y_max - y_min < 1e-12 {
                y_min -= 0.5;
                y_max += 0.5;
            }
            let pad = 0.05 * (y_max - y_min);
            let (lo, hi) = (y_min - pad, y_max + pad);
            draw_panel(area, title, series, text, x_max, lo..hi, (lo, hi), best)?;
        }
    }
    root.present().map_err(e)?;
    Ok(())
}

/// One panel: the curves of `series` over `0..x_max` on the y axis `y`, whose bounds are `y_bounds`, and a dashed
/// vertical line at the best checkpoint's step.
#[allow(clippy::too_many_arguments)]
fn draw_panel<DB: DrawingBackend, Y>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    series: &[Series],
    text: bool,
    x_max: f64,
    y: Y,
    y_bounds: (f64, f64),
    best_step: Option<f64>,
) -> std::result::Result<(), String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder.caption(title, ("sans-serif", 20)).x_label_area_size(36).y_label_area_size(56);
    }
    let mut chart = builder.build_cartesian_2d(0f64..x_max, y).map_err(e)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("optimizer step").x_label_formatter(&step_label).label_style(("sans-serif", 13));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(e)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let drawn = chart.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2))).map_err(e)?;
        if text {
            drawn
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        if pts.len() <= 40 {
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(e)?;
        }
    }
    if let Some(step) = best_step {
        let grey = RGBColor(90, 90, 90);
        let line = DashedLineSeries::new([(step, y_bounds.0), (step, y_bounds.1)], 6, 4, grey.stroke_width(2));
        let drawn = chart.draw_series(line).map_err(e)?;
        if text {
            drawn
                .label(format!("best checkpoint (step {step:.0})"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], grey.stroke_width(2)));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(e)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::LogEntry;

    #[test]
    fn writes_png_and_svg_with_both_panels() {
        let mut state = TrainerState::default();
        for step in 1..=20u64 {
            let mut values = std::collections::BTreeMap::new();
            values.insert("loss".to_string(), 2.0 / step as f64);
            if step % 5 == 0 {
                values.insert("eval_loss".to_string(), 2.2 / step as f64);
                values.insert("eval_accuracy".to_string(), 1.0 - 1.0 / step as f64);
                values.insert("eval_runtime".to_string(), 0.5);
            }
            state.log_history.push(LogEntry { epoch: step as f64 / 10.0, step, values });
        }
        let dir = tempfile::tempdir().unwrap();
        let files = plot_training_curves(&state, dir.path()).unwrap();
        assert_eq!(files.len(), 2);
        let png = std::fs::read(&files[0]).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let svg = std::fs::read_to_string(&files[1]).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{}", &svg[..100.min(svg.len())]);
        if font_available() {
            assert!(svg.contains("eval_accuracy") && !svg.contains("eval_runtime"));
        }
        assert!(plot_training_curves(&TrainerState::default(), dir.path()).unwrap().is_empty());
    }

    #[test]
    fn log_scale_when_the_loss_spans_two_decades_and_the_best_step_is_marked() {
        let series =
            |ys: &[f64]| vec![("loss".to_string(), ys.iter().enumerate().map(|(i, &y)| (i as f64, y)).collect())];
        assert!(use_log_scale(&series(&[5.0, 0.5, 0.04])));
        assert!(!use_log_scale(&series(&[5.0, 0.5, 0.06])), "125 / 1.25 = 83 < 100: linear");
        assert!(!use_log_scale(&series(&[5.0, 0.0, 0.001])), "a zero loss cannot go on a log axis");

        let mut state = TrainerState::default();
        for step in 1..=20u64 {
            let mut values = std::collections::BTreeMap::new();
            values.insert("loss".to_string(), 10f64.powi(-(step as i32) / 4)); // 1 .. 1e-5
            if step % 5 == 0 {
                values.insert("eval_accuracy".to_string(), step as f64 / 20.0);
            }
            state.log_history.push(LogEntry { epoch: step as f64 / 10.0, step, values });
        }
        state.best_global_step = Some(15);
        let dir = tempfile::tempdir().unwrap();
        let files = plot_training_curves(&state, dir.path()).unwrap();
        let svg = std::fs::read_to_string(&files[1]).unwrap();
        assert!(svg.contains("polyline"));
        if font_available() {
            assert!(svg.contains("loss (log scale)"), "the log axis is named in the title");
            assert_eq!(svg.matches("best checkpoint (step 15)").count(), 2, "marked on both panels");
        }
    }
}
