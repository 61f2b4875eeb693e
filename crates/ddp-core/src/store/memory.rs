//! An in-process store: the same semantics as the TCP store without a network. Used by world-size-1 groups
//! and by tests that run several ranks as threads of one process.

use super::Store;
use crate::sync;
use crate::{DdpError, Result};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A thread-safe in-memory [`Store`].
#[derive(Debug)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    timeout: Duration,
}

impl MemoryStore {
    /// An empty store whose blocking calls time out after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        MemoryStore { map: Mutex::new(HashMap::new()), changed: Condvar::new(), timeout }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(super::DEFAULT_STORE_TIMEOUT)
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        sync::lock(&self.map).insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.wait(&[key], self.timeout)?;
        Ok(sync::lock(&self.map).get(key).cloned().unwrap_or_default())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = sync::lock(&self.map);
        let current = match map.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()).ok_or_else(|| {
                DdpError::InvalidArgument(format!("store add: key {key:?} does not hold a decimal counter"))
            })?,
        };
        let new = current + delta;
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut map = sync::lock(&self.map);
        let matches = match map.get(key) {
            None => expected.is_empty(),
            Some(v) => v == expected,
        };
        if matches {
            map.insert(key.to_string(), desired.to_vec());
            drop(map);
            self.changed.notify_all();
            Ok(desired.to_vec())
        } else {
            Ok(map.get(key).cloned().unwrap_or_default())
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut map = sync::lock(&self.map);
        loop {
            let missing: Vec<String> = keys.iter().filter(|k| !map.contains_key(**k)).map(|k| k.to_string()).collect();
            if missing.is_empty() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(DdpError::StoreTimeout { keys: missing, waited });
            }
            map = sync::wait_timeout(&self.changed, map, timeout - waited).0;
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let map = sync::lock(&self.map);
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        Ok(sync::lock(&self.map).remove(key).is_some())
    }

    fn num_keys(&self) -> Result<usize> {
        Ok(sync::lock(&self.map).len())
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn get_blocks_until_set_and_times_out_naming_the_key() {
        let s = Arc::new(MemoryStore::new(Duration::from_millis(200)));
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.get("k").unwrap());
        std::thread::sleep(Duration::from_millis(20));
        s.set("k", b"v").unwrap();
        assert_eq!(t.join().unwrap(), b"v");
        let err = s.get("absent").unwrap_err().to_string();
        assert!(err.contains("absent"), "{err}");
        assert_eq!(s.add("c", 3).unwrap(), 3);
        assert_eq!(s.add("c", -1).unwrap(), 2);
        assert_eq!(s.compare_set("x", b"", b"1").unwrap(), b"1");
        assert_eq!(s.compare_set("x", b"0", b"2").unwrap(), b"1");
    }
}
