//! Rotary position embeddings as transformers' Llama applies them: inverse frequencies `θ^(−2i/d)` (rescaled as
//! the config's scaling type says), and `x · cos + rotate_half(x) · sin` on each head, where `rotate_half` swaps
//! the two halves of the head with the first negated — not candle's interleaved pairs (`rope_i`).

use super::config::{Rope, RopeScaling};
use candle_core::{Device, Result, Tensor, D};
use std::f64::consts::PI;

/// The rotary tables of one model: `cos` and `sin` `[max_positions, head_dim]` (each frequency twice, as
/// transformers concatenates `freqs` with itself), f32.
#[derive(Debug, Clone)]
pub(crate) struct RotaryTables {
    cos: Tensor,
    sin: Tensor,
}

/// The `head_dim / 2` inverse frequencies of `rope`, as transformers computes them (`rope_init_fn` of the type).
pub(crate) fn inverse_frequencies(rope: &Rope, head_dim: usize) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / rope.theta.powf((2 * i) as f64 / head_dim as f64)).collect();
    match rope.scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let old = original_max_position_embeddings as f64;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

impl RotaryTables {
    /// Tables for positions `0..max_positions`.
    pub(crate) fn new(rope: &Rope, head_dim: usize, max_positions: usize, device: &Device) -> Result<Self> {
        let freqs = inverse_frequencies(rope, head_dim);
        let mut cos = Vec::with_capacity(max_positions * head_dim);
        let mut sin = Vec::with_capacity(max_positions * head_dim);
        for p in 0..max_positions {
            // transformers: f32 frequencies times f32 positions, then cos/sin in f32.
            let row: Vec<f32> = freqs.iter().map(|&f| (f as f32) * (p as f32)).collect();
            for _ in 0..2 {
                cos.extend(row.iter().map(|a| a.cos()));
                sin.extend(row.iter().map(|a| a.sin()));
            }
        }
        Ok(RotaryTables {
            cos: Tensor::from_vec(cos, (max_positions, head_dim), device)?,
            sin: Tensor::from_vec(sin, (max_positions, head_dim), device)?,
        })
    }

    /// Rotates `x` `[b, s, heads, head_dim]` (positions `0..s`) in `x`'s dtype. Errors: `s` past the tables'
    /// positions (`max_position_embeddings`).
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (_, s, _, hd) = x.dims4()?;
        let max = self.cos.dim(0)?;
        if s > max {
            candle_core::bail!(
                "a sequence of {s} tokens is longer than max_position_embeddings = {max} (the rotary tables' \
                 positions): shorten the sequences or raise max_position_embeddings in config.json"
            );
        }
        let dtype = x.dtype();
        let table = |t: &Tensor| -> Result<Tensor> { t.narrow(0, 0, s)?.to_dtype(dtype)?.reshape((1, s, 1, hd)) };
        let (cos, sin) = (table(&self.cos)?, table(&self.sin)?);
        let half = hd / 2;
        let rotated = Tensor::cat(&[&x.narrow(D::Minus1, half, half)?.neg()?, &x.narrow(D::Minus1, 0, half)?], 3)?;
        x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 0.125,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let base = inverse_frequencies(&Rope { theta: 500_000.0, scaling: RopeScaling::Default }, 8);
        let scaled = inverse_frequencies(&Rope { theta: 500_000.0, scaling }, 8);
        // Wavelength 2π < 32/4: kept. 2π/0.0376 = 167 between 32/4 and 32/0.125: blended. The lowest
        // frequencies (wavelengths > 256): divided by 8.
        assert_eq!(scaled[0], base[0]);
        assert!(scaled[1] < base[1] && scaled[1] > base[1] / 8.0, "{scaled:?}");
        assert!((scaled[3] - base[3] / 8.0).abs() < 1e-15);
        let linear = inverse_frequencies(&Rope { theta: 100.0, scaling: RopeScaling::Linear { factor: 2.0 } }, 4);
        assert_eq!(linear, vec![0.5, 0.05]);
    }

    #[test]
    fn rotation_is_transformers_rotate_half() -> Result<()> {
        let rope = Rope { theta: 10_000.0, scaling: RopeScaling::Default };
        let tables = RotaryTables::new(&rope, 4, 8, &Device::Cpu)?;
        // One head, position 1, x = [1, 2, 3, 4]: frequencies [1, 0.01]; halves (1, 2) and (3, 4) pair up as
        // (x0, x2) and (x1, x3).
        let x = Tensor::from_vec(vec![0f32, 0., 0., 0., 1., 2., 3., 4.], (1, 2, 1, 4), &Device::Cpu)?;
        let y = tables.apply(&x)?.flatten_all()?.to_vec1::<f32>()?;
        let (c0, s0, c1, s1) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        let want = [1. * c0 - 3. * s0, 2. * c1 - 4. * s1, 3. * c0 + 1. * s0, 4. * c1 + 2. * s1];
        for (a, b) in y[4..].iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{y:?} vs {want:?}");
        }
        Ok(())
    }
}
