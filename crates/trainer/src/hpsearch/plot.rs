//! The study's plot, `study_dir/hp_search.{png,svg}`: left, the objective of every finished trial against its
//! number (complete trials as dots, pruned ones as crosses at their last report) with the running best as a
//! step line; right, each trial's reported metric against the step (pruned trials end with a cross). Same
//! backend and font handling as [`crate::plot`].

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use super::study::TrialState;
use super::StudySummary;
use crate::error::{Result, TrainerError};

/// File stem of the study plot.
pub const STUDY_PLOT_STEM: &str = "hp_search";

/// Writes `dir/hp_search.{png,svg}`; returns the files (none when no trial reported anything).
pub fn plot_study(summary: &StudySummary, dir: &Path) -> Result<Vec<PathBuf>> {
    if summary.trials.iter().all(|t| t.reports.is_empty() && t.value.is_none()) {
        return Ok(Vec::new());
    }
    let text = crate::plot::font_available();
    let size = (1120, 440);
    let png = dir.join(format!("{STUDY_PLOT_STEM}.png"));
    let svg = dir.join(format!("{STUDY_PLOT_STEM}.svg"));
    draw(BitMapBackend::new(&png, size).into_drawing_area(), summary, text)
        .map_err(|reason| TrainerError::Plot { path: png.clone(), reason })?;
    draw(SVGBackend::new(&svg, size).into_drawing_area(), summary, text)
        .map_err(|reason| TrainerError::Plot { path: svg.clone(), reason })?;
    Ok(vec![png, svg])
}

/// `(lo, hi)` of the values, padded by 5% (and widened when flat).
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        lo -= 0.5;
        hi += 0.5;
    }
    let pad = 0.05 * (hi - lo);
    (lo - pad, hi + pad)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    s: &StudySummary,
    text: bool,
) -> std::result::Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let areas = root.split_evenly((1, 2));

    // Left: objective per trial and the running best.
    let finished: Vec<(f64, f64, bool)> = s
        .trials
        .iter()
        .filter_map(|t| match t.state {
            TrialState::Complete => t.value.map(|v| (t.number as f64, v, false)),
            TrialState::Pruned => t.value.map(|v| (t.number as f64, v, true)),
            _ => None,
        })
        .collect();
    let x_max = s.trials.iter().map(|t| t.number as f64).fold(1.0, f64::max) + 0.5;
    let (y_lo, y_hi) = bounds(finished.iter().map(|p| p.1));
    let mut b = ChartBuilder::on(&areas[0]);
    b.margin(12);
    if text {
        b.caption(format!("{} per trial", s.metric), ("sans-serif", 18)).x_label_area_size(36).y_label_area_size(60);
    }
    let mut chart = b.build_cartesian_2d(-0.5f64..x_max, y_lo..y_hi).map_err(e)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("trial").label_style(("sans-serif", 12)).x_label_formatter(&|x| format!("{x:.0}"));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(e)?;
    let blue = Palette99::pick(0).to_rgba();
    let complete = chart
        .draw_series(finished.iter().filter(|p| !p.2).map(|&(x, y, _)| Circle::new((x, y), 4, blue.filled())))
        .map_err(e)?;
    if text {
        complete.label("complete").legend(move |(x, y)| Circle::new((x + 8, y), 4, blue.filled()));
    }
    let pruned = chart
        .draw_series(finished.iter().filter(|p| p.2).map(|&(x, y, _)| Cross::new((x, y), 5, RED.stroke_width(2))))
        .map_err(e)?;
    if text {
        pruned.label("pruned (last report)").legend(|(x, y)| Cross::new((x + 8, y), 5, RED.stroke_width(2)));
    }
    let mut best: Option<f64> = None;
    let mut running: Vec<(f64, f64)> = Vec::new();
    for &(x, y, was_pruned) in &finished {
        if !was_pruned && best.is_none_or(|b| s.direction.better(y, b)) {
            best = Some(y);
        }
        if let Some(b) = best {
            running.push((x, b));
        }
    }
    let green = GREEN.mix(0.9);
    let line = chart.draw_series(LineSeries::new(running, green.stroke_width(2))).map_err(e)?;
    if text {
        line.label("best so far").legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], green.stroke_width(2)));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(e)?;
    }

    // Right: each trial's reports against the step.
    let step_max = s.trials.iter().flat_map(|t| t.reports.iter().map(|r| r.0 as f64)).fold(1.0, f64::max);
    let (y_lo, y_hi) = bounds(s.trials.iter().flat_map(|t| t.reports.iter().filter_map(|r| r.1)));
    let mut b = ChartBuilder::on(&areas[1]);
    b.margin(12);
    if text {
        b.caption(format!("{} reports", s.metric), ("sans-serif", 18)).x_label_area_size(36).y_label_area_size(60);
    }
    let mut chart = b.build_cartesian_2d(0f64..step_max * 1.02, y_lo..y_hi).map_err(e)?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("optimizer step").label_style(("sans-serif", 12)).x_label_formatter(&|x| format!("{x:.0}"));
    } else {
        mesh.disable_x_axis().disable_y_axis();
    }
    mesh.draw().map_err(e)?;
    for t in &s.trials {
        let pts: Vec<(f64, f64)> = t.reports.iter().filter_map(|r| r.1.map(|v| (r.0 as f64, v))).collect();
        if pts.is_empty() {
            continue;
        }
        let color = if t.state == TrialState::Pruned {
            RED.mix(0.45)
        } else {
            Palette99::pick(t.number as usize + 1).to_rgba()
        };
        chart.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(1))).map_err(e)?;
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 2, color.filled()))).map_err(e)?;
        if t.state == TrialState::Pruned {
            let last = *pts.last().expect("not empty");
            chart.draw_series(std::iter::once(Cross::new(last, 5, RED.stroke_width(2)))).map_err(e)?;
        }
    }
    root.present().map_err(e)?;
    Ok(())
}
