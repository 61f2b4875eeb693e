//! Locking shared by every ddp-core module (public so that `accel` can use the same policy).

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Locks `mutex`, ignoring poisoning.
///
/// A mutex is poisoned when a thread panicked while holding it. In ddp-core that panic is about to take the
/// whole job down anyway (the launcher stops every rank when one fails), and every critical section leaves the
/// guarded data consistent (single inserts, removals and swaps), so the other threads keep going with the data
/// as it is instead of turning one panic into a cascade of secondary `PoisonError` panics.
///
/// ```
/// use std::sync::Mutex;
/// let m = Mutex::new(1);
/// *ddp_core::sync::lock(&m) += 1;
/// assert_eq!(*ddp_core::sync::lock(&m), 2);
/// ```
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// [`Condvar::wait_timeout`] under the same policy as [`lock`]: returns the re-acquired guard (poisoned or not)
/// and whether the wait timed out.
pub fn wait_timeout<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, bool) {
    let (guard, result) = condvar.wait_timeout(guard, timeout).unwrap_or_else(PoisonError::into_inner);
    (guard, result.timed_out())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_poisoned_mutex_still_locks_with_its_data() {
        let m = std::sync::Arc::new(std::sync::Mutex::new(vec![1]));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        super::lock(&m).push(2);
        assert_eq!(*super::lock(&m), vec![1, 2]);
    }
}
