//! [`ProgressCallback`]: an indicatif progress bar over the optimizer steps, on rank 0 only and only when stderr
//! is a terminal (HF's tqdm bar), and [`ConsoleWriter`], which prints lines above the bar when one is shown.
//! The bar needs the cargo feature `progress`; without it [`ConsoleWriter`] prints plain lines.

#[cfg(feature = "progress")]
use std::io::IsTerminal;
#[cfg(feature = "progress")]
use std::sync::{Arc, Mutex};

#[cfg(feature = "progress")]
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[cfg(feature = "progress")]
use super::{CallbackContext, TrainerCallback, TrainerControl};
#[cfg(feature = "progress")]
use crate::error::Result;
#[cfg(feature = "progress")]
use crate::metrics::Metrics;

/// Prints whole lines to stdout, or through the active progress bar (so the bar is redrawn below the line).
/// Cheap to clone; shared by `ProgressCallback` and [`super::PrinterCallback`].
#[derive(Debug, Clone, Default)]
pub struct ConsoleWriter {
    #[cfg(feature = "progress")]
    bar: Arc<Mutex<Option<ProgressBar>>>,
}

impl ConsoleWriter {
    /// A writer with no bar attached (plain stdout).
    pub fn new() -> Self {
        Self::default()
    }

    /// Prints `line` followed by a newline.
    pub fn println(&self, line: &str) {
        #[cfg(feature = "progress")]
        if let Some(b) = crate::lock(&self.bar).as_ref().filter(|b| !b.is_hidden()) {
            b.println(line);
            return;
        }
        println!("{line}");
    }

    #[cfg(feature = "progress")]
    fn attach(&self, bar: Option<ProgressBar>) {
        *crate::lock(&self.bar) = bar;
    }
}

/// A progress bar `global_step / max_steps` with the latest training loss, drawn on stderr by rank 0 when stderr is
/// a terminal and `disable_tqdm` is false; otherwise it does nothing (cheap: one atomic store per step).
#[cfg(feature = "progress")]
#[cfg_attr(docsrs, doc(cfg(feature = "progress")))]
#[derive(Debug)]
pub struct ProgressCallback {
    console: ConsoleWriter,
    bar: Option<ProgressBar>,
}

#[cfg(feature = "progress")]
impl ProgressCallback {
    /// A progress callback printing through `console` (share it with the [`super::PrinterCallback`]).
    pub fn new(console: ConsoleWriter) -> Self {
        ProgressCallback { console, bar: None }
    }

    /// Whether a bar is currently shown.
    pub fn is_visible(&self) -> bool {
        self.bar.as_ref().is_some_and(|b| !b.is_hidden())
    }
}

#[cfg(feature = "progress")]
impl TrainerCallback for ProgressCallback {
    fn on_train_begin(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> Result<()> {
        if !ctx.is_world_process_zero() || ctx.args.disable_tqdm || !std::io::stderr().is_terminal() {
            return Ok(());
        }
        let bar = ProgressBar::with_draw_target(Some(ctx.state.max_steps), ProgressDrawTarget::stderr_with_hz(10));
        let style = ProgressStyle::with_template(
            "{bar:40.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("█▉▊▋▌▍▎▏ ");
        bar.set_style(style);
        bar.set_position(ctx.state.global_step);
        self.console.attach(Some(bar.clone()));
        self.bar = Some(bar);
        Ok(())
    }

    fn on_step_end(&mut self, ctx: &CallbackContext, _control: &mut TrainerControl) -> Result<()> {
        if let Some(bar) = &self.bar {
            bar.set_position(ctx.state.global_step);
        }
        Ok(())
    }

    fn on_evaluate(&mut self, _ctx: &CallbackContext, _c: &mut TrainerControl, metrics: &Metrics) -> Result<()> {
        if let (Some(bar), Some(loss)) = (&self.bar, metrics.get("eval_loss")) {
            bar.set_message(format!("eval_loss {loss:.4}"));
        }
        Ok(())
    }

    fn on_log(
        &mut self,
        _ctx: &CallbackContext,
        _control: &mut TrainerControl,
        logs: &crate::state::LogEntry,
    ) -> Result<()> {
        if let (Some(bar), Some(loss)) = (&self.bar, logs.get("loss")) {
            bar.set_message(format!("loss {loss:.4}"));
        }
        Ok(())
    }

    fn on_train_end(&mut self, _ctx: &CallbackContext, _control: &mut TrainerControl) -> Result<()> {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.console.attach(None);
        Ok(())
    }
}
