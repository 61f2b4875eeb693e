//! The exact state of a ChaCha8 random number generator as JSON, so a resumed run draws the same numbers as the
//! uninterrupted one (`random_states_{rank}.json`, Accelerate's `random_states_{i}.pkl`).
//!
//! A ChaCha stream is fully described by its 256-bit key (the seed), its 64-bit stream id and its position in
//! 32-bit words (RFC 8439 / Bernstein's ChaCha; `rand_chacha` exposes all three).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{AccelError, Result};

/// Serializable position of a [`ChaCha8Rng`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// Algorithm name, always `"chacha8"` (checked on restore).
    pub algorithm: String,
    /// The 32-byte key, lowercase hex (64 characters).
    pub seed: String,
    /// Stream id.
    pub stream: u64,
    /// Position in 32-bit words since the start of the stream, decimal (a u128 does not fit in JSON numbers).
    pub word_pos: String,
}

impl RngState {
    /// Captures `rng`'s state (does not advance it).
    pub fn capture(rng: &ChaCha8Rng) -> Self {
        RngState {
            algorithm: "chacha8".into(),
            seed: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// A generator in exactly the captured state. Errors name the malformed field.
    pub fn restore(&self) -> Result<ChaCha8Rng> {
        if self.algorithm != "chacha8" {
            return Err(AccelError::InvalidArgument(format!(
                "RNG state is for {:?}, expected \"chacha8\"",
                self.algorithm
            )));
        }
        let bad_seed = || AccelError::InvalidArgument(format!("RNG state: seed {:?} is not 64 hex digits", self.seed));
        if self.seed.len() != 64 || !self.seed.is_ascii() {
            return Err(bad_seed());
        }
        let mut key = [0u8; 32];
        for (i, b) in key.iter_mut().enumerate() {
            *b = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16).map_err(|_| bad_seed())?;
        }
        let pos: u128 = self.word_pos.parse().map_err(|_| {
            AccelError::InvalidArgument(format!("RNG state: word_pos {:?} is not a decimal integer", self.word_pos))
        })?;
        let mut rng = ChaCha8Rng::from_seed(key);
        rng.set_stream(self.stream);
        rng.set_word_pos(pos);
        Ok(rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore};

    #[test]
    fn restored_generator_continues_the_same_sequence() {
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        rng.set_stream(3);
        // Stop at an odd word position, inside a generated block.
        let _: u32 = rng.next_u32();
        let _: f64 = rng.random();
        let state = RngState::capture(&rng);
        let json = serde_json::to_string(&state).unwrap();
        let mut back = serde_json::from_str::<RngState>(&json).unwrap().restore().unwrap();
        let a: Vec<u64> = (0..100).map(|_| rng.next_u64()).collect();
        let b: Vec<u64> = (0..100).map(|_| back.next_u64()).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn malformed_state_is_rejected() {
        let mut s = RngState::capture(&ChaCha8Rng::seed_from_u64(1));
        s.seed.truncate(10);
        assert!(s.restore().unwrap_err().to_string().contains("64 hex digits"));
    }
}
