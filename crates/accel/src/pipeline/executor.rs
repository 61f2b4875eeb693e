//! Runs one rank's action list of a [`PipelineSchedule`] on its stages of a model: forwards, the loss on the
//! last stage, backwards from the gradient that arrives for a stage's output
//! ([`ddp_core::segments::backward_from`]), activations and gradients over the [`PipelineLinks`].
//!
//! - Receives block on this thread; sends are handed to a sender thread in schedule order (asynchronous, as the
//!   schedules assume), which this call waits for before it returns.
//! - Activation shapes are agreed over the links, not declared: the first activation a stage sends to the next
//!   rank is preceded by an 8-number header (dtype, rank, dimensions), once per [`ShapeBook`]; the receiver keeps
//!   it and allocates every later activation of that stage from it. Gradients travel back in their output's
//!   shape, which the receiver holds.
//! - A stage's input arrives as a fresh leaf variable, so the backward yields its gradient, which goes back to
//!   the previous stage. On one rank holding two consecutive stages (interleaved, pp = 1) the tensor is handed over
//!   in memory.
//! - The loss is the model's: [`PipelineModel::loss`] must already be normalised for the whole step (divided by
//!   the global number of items over every micro-batch, accumulation step and data-parallel rank), so that the
//!   gradients summed here over the micro-batches are the step's gradients with no rescaling after (torchtitan
//!   #1733).
//! - Gradients are summed per parameter in backward order (every schedule backwards a stage's micro-batches in
//!   ascending order, so GPipe and 1F1B give the same sums bit for bit).

use super::links::PipelineLinks;
use super::schedule::{Action, PipelineSchedule};
use crate::{AccelError, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Shape, Tensor, Var};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// A model cut into stages, as one pipeline rank sees it (its own stages only).
pub trait PipelineModel {
    /// The forward of `stage` on `microbatch`. `input` is the previous stage's output; `None` on stage 0, which
    /// reads the micro-batch's data itself.
    fn forward(&mut self, stage: usize, microbatch: usize, input: Option<&Tensor>) -> Result<Tensor>;

    /// On the last stage: the loss of `microbatch` from the stage's output, normalised for the whole step (see
    /// the module documentation). A scalar.
    fn loss(&mut self, microbatch: usize, output: &Tensor) -> Result<Tensor>;

    /// The parameters of this rank's stages, whose gradients the step sums.
    fn parameters(&self) -> Vec<Var>;
}

/// The activation shapes agreed over this rank's links (see the module documentation): keep one per run and pass
/// it to every [`run_schedule`]; start a new one (on every rank alike) when the micro-batch shape changes.
#[derive(Debug, Default, Clone)]
pub struct ShapeBook {
    /// Stages whose input this rank sent a header for.
    sent: HashSet<usize>,
    /// The input shape and dtype of each stage this rank receives activations for.
    received: HashMap<usize, (Shape, DType)>,
}

/// The dtypes a header can name, by code.
const HEADER_DTYPES: [DType; 7] = [DType::F32, DType::F16, DType::BF16, DType::F64, DType::U8, DType::U32, DType::I64];
/// Header length: dtype code, rank, up to 6 dimensions.
const HEADER_LEN: usize = 8;

fn shape_header(t: &Tensor) -> Result<Tensor> {
    let code = HEADER_DTYPES.iter().position(|d| *d == t.dtype()).ok_or_else(|| {
        AccelError::InvalidArgument(format!("pipeline: activations of dtype {:?} cannot be sent", t.dtype()))
    })?;
    if t.rank() > HEADER_LEN - 2 {
        return Err(AccelError::InvalidArgument(format!(
            "pipeline: activations of rank {} cannot be sent (at most {} dimensions)",
            t.rank(),
            HEADER_LEN - 2
        )));
    }
    let mut h = vec![0i64; HEADER_LEN];
    h[0] = code as i64;
    h[1] = t.rank() as i64;
    for (slot, d) in h[2..].iter_mut().zip(t.dims()) {
        *slot = *d as i64;
    }
    Ok(Tensor::from_vec(h, HEADER_LEN, &candle_core::Device::Cpu)?)
}

fn read_header(h: &Tensor) -> Result<(Shape, DType)> {
    let h = h.to_vec1::<i64>()?;
    let dtype = HEADER_DTYPES.get(h[0] as usize).copied().ok_or_else(|| {
        AccelError::InvalidArgument(format!("pipeline: a shape header names dtype code {}: not a header", h[0]))
    })?;
    let rank = (h[1] as usize).min(HEADER_LEN - 2);
    Ok((Shape::from(h[2..2 + rank].iter().map(|&d| d as usize).collect::<Vec<_>>()), dtype))
}

/// What one step of the schedule gave on this rank.
pub struct PipelineStep {
    /// The loss of each micro-batch, on the rank holding the last stage (empty elsewhere).
    pub losses: Vec<f64>,
    /// The gradient of each of [`PipelineModel::parameters`], summed over the micro-batches in fp32 (`None`: no
    /// gradient reached it).
    pub gradients: Vec<Option<Tensor>>,
    /// Start and end (seconds since the step began) of each forward and backward, in order: the measured
    /// timeline, from which the bubble is read.
    pub timeline: Vec<(Action, f64, f64)>,
}

/// What a forward left for its backward.
struct Stash {
    input: Option<Var>,
    output: Tensor,
    loss: Option<Tensor>,
    /// Under activation checkpointing: the cuts the stage's forward recorded (its checkpointed blocks are
    /// recomputed by the backward).
    segments: Option<ddp_core::segments::BackwardSegments>,
}

/// Runs this rank's actions of `schedule` (this rank: [`PipelineLinks::rank`]).
///
/// Errors: the model's; a send or receive that failed — a stage that died or stalls, within the collective
/// timeout — naming the stage, the micro-batch, the action, this pp rank and the peer, with the backend's error; [`AccelError::InvalidArgument`] for a schedule whose shape is not the links' or that
/// asks for a tensor this rank does not have (check schedules with [`super::simulate::simulate`] first).
pub fn run_schedule(
    schedule: &PipelineSchedule,
    links: &PipelineLinks,
    model: &mut dyn PipelineModel,
    shapes: &mut ShapeBook,
) -> Result<PipelineStep> {
    if schedule.pp != links.pp() {
        return Err(AccelError::InvalidArgument(format!(
            "pipeline: a schedule for pp = {} on a pp group of {} ranks",
            schedule.pp,
            links.pp()
        )));
    }
    let me = links.rank();
    std::thread::scope(|scope| -> Result<PipelineStep> {
        // Sends go out on a thread of their own, so that a stage computes while its last output travels.
        let (tx, rx) = std::sync::mpsc::channel::<(Tensor, usize, Action)>();
        let sender = scope.spawn(move || -> Result<()> {
            for (t, peer, action) in rx {
                let (group, dst) = links.to(peer).ok_or_else(|| no_link("send to", peer))?;
                group.send_tensor(&t, dst).map_err(|e| failed(links, action, me, peer, e))?;
            }
            Ok(())
        });
        let params = model.parameters();
        let mut rank = RankStep {
            schedule,
            links,
            shapes,
            me,
            t0: Instant::now(),
            step: PipelineStep { losses: Vec::new(), gradients: vec![None; params.len()], timeline: Vec::new() },
            params,
            tx,
            stash: HashMap::new(),
            inbox: HashMap::new(),
            local: HashMap::new(),
            input_grads: HashMap::new(),
        };
        let run = schedule.ranks[me].iter().try_for_each(|&action| match action {
            Action::RecvActivation { .. } | Action::RecvGradient { .. } => rank.receive(action),
            Action::Forward { .. } => rank.forward(action, model),
            Action::Backward { .. } => rank.backward(action),
            Action::SendActivation { .. } | Action::SendGradient { .. } => rank.send(action),
        });
        let RankStep { step, tx, .. } = rank;
        drop(tx);
        let sent =
            sender.join().map_err(|_| AccelError::InvalidArgument("pipeline: the sender thread panicked".into()))?;
        run?;
        sent?;
        Ok(step)
    })
}

/// One rank's part of one pipeline step while it runs its actions: what it has received, computed and still has
/// to send.
struct RankStep<'a> {
    schedule: &'a PipelineSchedule,
    links: &'a PipelineLinks,
    shapes: &'a mut ShapeBook,
    /// This rank in the pp group.
    me: usize,
    t0: Instant,
    /// The step's losses, gradient sums and timeline, returned at the end.
    step: PipelineStep,
    params: Vec<Var>,
    /// To the sender thread: (tensor, peer, the send action).
    tx: std::sync::mpsc::Sender<(Tensor, usize, Action)>,
    /// Each (stage, micro-batch) forward's input, output and loss, until its backward.
    stash: HashMap<(usize, usize), Stash>,
    /// Received, not yet used.
    inbox: HashMap<Action, Tensor>,
    /// Sent to a stage on this rank.
    local: HashMap<Action, Tensor>,
    /// Each backward's gradient of its stage input, until it is sent.
    input_grads: HashMap<(usize, usize), Tensor>,
}

impl RankStep<'_> {
    /// A received activation (from the stage before) or gradient (from the stage after), into the inbox.
    fn receive(&mut self, action: Action) -> Result<()> {
        let (stage, mb) = action.at();
        let (from_stage, sent) = match action {
            Action::RecvActivation { .. } => (stage - 1, Action::SendActivation { stage: stage - 1, microbatch: mb }),
            _ => (stage + 1, Action::SendGradient { stage: stage + 1, microbatch: mb }),
        };
        let (me, links) = (self.me, self.links);
        let peer = self.schedule.rank_of(from_stage);
        let t = if peer == me {
            self.local.remove(&sent).ok_or_else(|| missing(action))?
        } else {
            let (group, src) = links.from(peer).ok_or_else(|| no_link("receive from", peer))?;
            let (shape, dtype) = match action {
                // An activation's shape is sent once per stage, before the first one.
                Action::RecvActivation { .. } => match self.shapes.received.get(&stage) {
                    Some(known) => known.clone(),
                    None => {
                        let h = group
                            .recv_tensor(HEADER_LEN, DType::I64, src)
                            .map_err(|e| failed(links, action, me, peer, e))?;
                        let agreed = read_header(&h)?;
                        self.shapes.received.insert(stage, agreed.clone());
                        agreed
                    }
                },
                // A gradient has the shape of the output it is the gradient of.
                _ => {
                    let out = &self.stash.get(&(stage, mb)).ok_or_else(|| missing(action))?.output;
                    (out.shape().clone(), out.dtype())
                }
            };
            group.recv_tensor(shape, dtype, src).map_err(|e| failed(links, action, me, peer, e))?
        };
        self.inbox.insert(action, t);
        Ok(())
    }

    /// A stage's forward on its received input (the data, at stage 0), its loss at the last stage; stashed.
    fn forward(&mut self, action: Action, model: &mut dyn PipelineModel) -> Result<()> {
        let (stage, mb) = action.at();
        let start = self.t0.elapsed().as_secs_f64();
        let input = match stage {
            0 => None,
            _ => {
                let t = self
                    .inbox
                    .remove(&Action::RecvActivation { stage, microbatch: mb })
                    .ok_or_else(|| missing(action))?;
                Some(Var::from_tensor(&t)?)
            }
        };
        let input_tensor = input.as_ref().map(Var::as_tensor);
        // Activation checkpointing: the forward recorded, so its checkpointed blocks keep no activations (the
        // backward recomputes them, segment by segment).
        let (output, segments) = if crate::activation_checkpoint::enabled() {
            let (o, cuts) = ddp_core::segments::record(|| model.forward(stage, mb, input_tensor))?;
            (o, Some(cuts))
        } else {
            (model.forward(stage, mb, input_tensor)?, None)
        };
        let loss = if stage == self.schedule.num_stages() - 1 { Some(model.loss(mb, &output)?) } else { None };
        if let Some(l) = &loss {
            self.step.losses.push(l.to_dtype(DType::F64)?.to_scalar::<f64>()?);
        }
        self.stash.insert((stage, mb), Stash { input, output, loss, segments });
        self.step.timeline.push((action, start, self.t0.elapsed().as_secs_f64()));
        Ok(())
    }

    /// A stage's backward from its loss (last stage) or its output's received gradient: the parameters'
    /// gradients summed into the step's, its input's kept for the send.
    fn backward(&mut self, action: Action) -> Result<()> {
        let (stage, mb) = action.at();
        let start = self.t0.elapsed().as_secs_f64();
        let mut s = self.stash.remove(&(stage, mb)).ok_or_else(|| missing(action))?;
        let grad = match &s.loss {
            Some(_) => None,
            None => Some(
                self.inbox.remove(&Action::RecvGradient { stage, microbatch: mb }).ok_or_else(|| missing(action))?,
            ),
        };
        // The gradients of the stage's parameters (summed into the step's, in fp32 whatever the compute dtype, as
        // the step owner's slots) and of its input, from one store or, under activation checkpointing, from each
        // segment's.
        let mut input_grad: Option<Tensor> = None;
        let (gradients, params) = (&mut self.step.gradients, &self.params);
        let mut absorb = |store: GradStore| -> Result<()> {
            for (slot, p) in gradients.iter_mut().zip(params) {
                if let Some(g) = store.get(p.as_tensor()) {
                    add_into(slot, g.to_dtype(DType::F32)?)?;
                }
            }
            if let Some(g) = s.input.as_ref().and_then(|i| store.get(i.as_tensor())) {
                add_into(&mut input_grad, g.clone())?;
            }
            Ok(())
        };
        match (s.segments.take(), &s.loss, &grad) {
            (None, Some(loss), _) => absorb(loss.backward()?)?,
            (None, None, Some(grad)) => absorb(ddp_core::segments::backward_from(&s.output, grad)?)?,
            (Some(cuts), Some(loss), _) => cuts.backward(loss, |_, store| absorb(store))?,
            (Some(cuts), None, Some(grad)) => cuts.backward_from(&s.output, grad, |_, store| absorb(store))?,
            (_, None, None) => return Err(missing(action)),
        }
        if let Some(input) = &s.input {
            let g = match input_grad {
                Some(g) => g,
                None => input.zeros_like()?,
            };
            self.input_grads.insert((stage, mb), g);
        }
        self.step.timeline.push((action, start, self.t0.elapsed().as_secs_f64()));
        Ok(())
    }

    /// A stage's output to the next stage, or its input's gradient to the one before: kept when that stage is on
    /// this rank, else handed to the sender thread (with the shape first, once per stage, for an activation).
    fn send(&mut self, action: Action) -> Result<()> {
        let (stage, mb) = action.at();
        let (t, to_stage) = match action {
            Action::SendActivation { .. } => {
                (self.stash.get(&(stage, mb)).ok_or_else(|| missing(action))?.output.clone(), stage + 1)
            }
            _ => (self.input_grads.remove(&(stage, mb)).ok_or_else(|| missing(action))?, stage - 1),
        };
        let peer = self.schedule.rank_of(to_stage);
        if peer == self.me {
            self.local.insert(action, t);
        } else {
            // The sender thread is gone only if a send failed: its error is returned at the end of the step.
            if matches!(action, Action::SendActivation { .. }) && self.shapes.sent.insert(to_stage) {
                let _ = self.tx.send((shape_header(&t)?, peer, action));
            }
            let _ = self.tx.send((t.detach(), peer, action));
        }
        Ok(())
    }
}

/// Adds `g` to the sum in `slot`.
fn add_into(slot: &mut Option<Tensor>, g: Tensor) -> candle_core::Result<()> {
    *slot = Some(match slot.take() {
        Some(acc) => (acc + g)?,
        None => g,
    });
    Ok(())
}

/// A send or receive that failed (a dead or stuck peer: the backend names it and the collective), with the
/// stage, the micro-batch, this rank and the peer.
fn failed(links: &PipelineLinks, action: Action, me: usize, peer: usize, e: ddp_core::DdpError) -> AccelError {
    let (stage, mb) = action.at();
    let what = match action {
        Action::SendActivation { .. } => "sending the activation to",
        Action::SendGradient { .. } => "sending the input gradient to",
        Action::RecvActivation { .. } => "receiving the activation from",
        _ => "receiving the output gradient from",
    };
    AccelError::Pipeline {
        context: format!(
            "pipeline stage {stage}, micro-batch {mb} ({action}) on pp rank {me} (rank {}): {what} pp rank {peer} (rank \
             {})",
            links.global_rank(me),
            links.global_rank(peer)
        ),
        source: Box::new(e),
    }
}

fn missing(action: Action) -> AccelError {
    AccelError::InvalidArgument(format!(
        "pipeline: {action} needs a tensor this rank does not have (check the schedule with pipeline::simulate)"
    ))
}

fn no_link(what: &str, peer: usize) -> AccelError {
    AccelError::InvalidArgument(format!(
        "pipeline: no link to {what} pp rank {peer} (schedules send only between neighbouring pp ranks)"
    ))
}
