//! The run token: a shared secret every process of a job presents before it is trusted.
//!
//! The launcher draws a fresh 128-bit token per job and passes it in [`RUN_TOKEN_ENV`]; the store server and the
//! CPU backend's peer listener refuse any connection that does not present it. For multi-machine jobs the user
//! exports the same token on every machine.

use crate::{DdpError, Result};

/// Environment variable carrying the run token (32 lowercase hex digits).
pub const RUN_TOKEN_ENV: &str = "ACCEL_RUN_TOKEN";

/// A 128-bit shared secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RunToken([u8; 16]);

impl std::fmt::Debug for RunToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret itself.
        f.write_str("RunToken(..)")
    }
}

impl RunToken {
    /// Draws a fresh token from the OS's random source.
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)
            .map_err(|e| DdpError::io("drawing a run token", std::io::Error::other(e.to_string())))?;
        Ok(RunToken(bytes))
    }

    /// The token as raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 32 hex digits.
    pub fn from_hex(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(DdpError::Env {
                var: RUN_TOKEN_ENV.into(),
                reason: format!(
                    "expected 32 hex digits, got {} characters; generate one with `openssl rand -hex 16`",
                    s.len()
                ),
            });
        }
        let mut bytes = [0u8; 16];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(RunToken(bytes))
    }

    /// Reads [`RUN_TOKEN_ENV`]; `Ok(None)` when unset.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(RUN_TOKEN_ENV) {
            Ok(s) => Self::from_hex(&s).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(e) => Err(DdpError::Env { var: RUN_TOKEN_ENV.into(), reason: e.to_string() }),
        }
    }

    /// Constant-time comparison with bytes received from a peer.
    pub fn matches(&self, other: &[u8]) -> bool {
        other.len() == 16 && self.0.iter().zip(other).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_bad_input() {
        let t = RunToken::generate().unwrap();
        assert_eq!(RunToken::from_hex(&t.to_hex()).unwrap(), t);
        assert!(t.matches(t.as_bytes()));
        assert!(!t.matches(&[0u8; 16]) || t.as_bytes() == &[0u8; 16]);
        let err = RunToken::from_hex("abc").unwrap_err().to_string();
        assert!(err.contains("ACCEL_RUN_TOKEN") && err.contains("32 hex digits"), "{err}");
    }
}
