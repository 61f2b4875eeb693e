//! A namespaced view of a store (like PyTorch's `PrefixStore`): sub-groups and separate phases of a job use
//! their own prefix so their keys never collide.

use super::Store;
use crate::Result;
use std::sync::Arc;
use std::time::Duration;

/// A [`Store`] whose keys are `"{prefix}/{key}"` in the underlying store. Prefix stores nest.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore").field("prefix", &self.prefix).finish()
    }
}

impl PrefixStore {
    /// A view of `inner` in which every key is stored as `"{prefix}/{key}"`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The underlying store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        // Errors name the full (prefixed) keys: that is what tells a user which group was waiting.
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.key(key))
    }
    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}
