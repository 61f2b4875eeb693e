//! The run token: a shared secret every process of a job presents before it is trusted.
//!
//! The launcher draws a fresh 128-bit token per job and passes it in [`RUN_TOKEN_ENV`]; the store server and the
//! CPU backend's peer listener refuse any connection that does not present it. For multi-machine jobs the user
//! exports the same token on every machine.
//!
//! The token itself never goes on the wire: peers prove they know it with HMAC-SHA256 (RFC 2104) over fresh
//! nonces from both sides and a role label (`RunToken::prove`), a mutual challenge-response. A passive listener
//! or a fake server learns only MACs over nonces that are never used again.

use crate::{DdpError, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of a [`RunToken::prove`] MAC (HMAC-SHA256), in bytes.
pub(crate) const MAC_LEN: usize = 32;
/// Length of the nonces each side of a handshake draws, in bytes.
pub(crate) const NONCE_LEN: usize = 16;

/// `NONCE_LEN` fresh random bytes from the OS.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| DdpError::io("drawing a nonce", std::io::Error::other(e.to_string())))?;
    Ok(n)
}

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

    /// HMAC-SHA256 (RFC 2104) keyed with the token over `label || server_nonce || client_nonce`: the proof of
    /// knowledge one side of a challenge-response handshake sends. `label` names the sender's role (e.g.
    /// `b"accel-store v2 client"`), so an answer reflected back to its sender does not verify. 32 bytes.
    pub(crate) fn prove(&self, label: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> [u8; MAC_LEN] {
        self.mac(label, server_nonce, client_nonce).finalize().into_bytes().into()
    }

    /// Whether `mac` is [`Self::prove`]`(label, server_nonce, client_nonce)`, compared in constant time.
    pub(crate) fn verify(&self, label: &[u8], server_nonce: &[u8], client_nonce: &[u8], mac: &[u8]) -> bool {
        self.mac(label, server_nonce, client_nonce).verify_slice(mac).is_ok()
    }

    fn mac(&self, label: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        // Length-prefix the label so that no (label, nonce) pair can be re-split into another.
        m.update(&(label.len() as u32).to_le_bytes());
        m.update(label);
        m.update(server_nonce);
        m.update(client_nonce);
        m
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

    #[test]
    fn proofs_bind_token_label_and_both_nonces() {
        // Every input changes the proof.
        let t = RunToken::from_hex("000102030405060708090a0b0c0d0e0f").unwrap();
        let (sn, cn) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = t.prove(b"server", &sn, &cn);
        assert!(t.verify(b"server", &sn, &cn, &p));
        assert!(!t.verify(b"client", &sn, &cn, &p), "a reflected proof must not verify");
        assert!(!t.verify(b"server", &cn, &sn, &p), "nonces are ordered");
        assert!(!t.verify(b"server", &[3u8; NONCE_LEN], &cn, &p), "a new server nonce needs a new proof");
        assert!(!t.verify(b"server", &sn, &cn, &p[..31]));
        let other = RunToken::from_hex("ff0102030405060708090a0b0c0d0e0f").unwrap();
        assert!(!other.verify(b"server", &sn, &cn, &p));
        // Independent computation of the documented construction.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(t.as_bytes()).unwrap();
        m.update(&6u32.to_le_bytes());
        m.update(b"server");
        m.update(&sn);
        m.update(&cn);
        assert_eq!(p, <[u8; MAC_LEN]>::from(m.finalize().into_bytes()));
    }
}
