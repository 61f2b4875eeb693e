//! Process-wide MPI state: `MPI_Init_thread` once, `MPI_Finalize` at process exit.
//!
//! MPI can be initialised once per process and never again after `MPI_Finalize`, while process groups come and
//! go. So the first MPI process group initialises MPI (asking for `MPI_THREAD_MULTIPLE`), keeps rsmpi's `Universe`
//! in a static and finalises it from an `atexit` handler: `mpirun` treats a rank that exits without
//! `MPI_Finalize` as failed. If the program initialised MPI itself (rsmpi or C), we use it and leave finalising
//! to the program.

use crate::{DdpError, Result};
use mpi::ffi;
use std::ffi::c_char;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// What the MPI library provides, read once.
#[derive(Debug)]
pub struct MpiRuntime {
    /// Whether MPI_THREAD_MULTIPLE was granted (else every MPI call takes [`MpiRuntime::serialize`]'s lock).
    pub thread_multiple: bool,
    /// `MPI_Get_library_version`'s first line, e.g. "Open MPI v4.1.4, ...".
    pub library: String,
    /// The value of `MPI_IN_PLACE` for this library family (a C macro, not exported by mpi-sys), when known.
    pub(crate) in_place: Option<usize>,
    /// Held around MPI calls when the library is not thread-multiple.
    lock: Mutex<()>,
}

static RUNTIME: OnceLock<std::result::Result<MpiRuntime, String>> = OnceLock::new();
/// The universe we initialised (finalised at exit); `None` when the program owns MPI.
static UNIVERSE: Mutex<Option<mpi::environment::Universe>> = Mutex::new(None);

/// Initialises MPI on first use and returns its facts. Errors: [`DdpError::BackendUnavailable`] when MPI was
/// already finalised or cannot be initialised.
pub fn runtime() -> Result<&'static MpiRuntime> {
    RUNTIME
        .get_or_init(init)
        .as_ref()
        .map_err(|reason| DdpError::BackendUnavailable { backend: "mpi", reason: reason.clone() })
}

impl MpiRuntime {
    /// A guard to hold around an MPI call: the process-wide lock when the library only grants
    /// MPI_THREAD_SERIALIZED or less, nothing when it is thread-multiple.
    pub(crate) fn serialize(&self) -> Option<MutexGuard<'_, ()>> {
        if self.thread_multiple {
            None
        } else {
            Some(crate::sync::lock(&self.lock))
        }
    }
}

fn init() -> std::result::Result<MpiRuntime, String> {
    let mut finalized = 0;
    // SAFETY: MPI_Finalized may be called at any time, before MPI_Init too.
    unsafe { ffi::MPI_Finalized(&mut finalized) };
    if finalized != 0 {
        return Err("MPI was already finalized in this process and cannot be initialised again".into());
    }
    let provided = if mpi::environment::is_initialized() {
        tracing::debug!("MPI already initialised by the program; using it");
        mpi::environment::threading_support()
    } else {
        let (universe, provided) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| "MPI_Init_thread failed (is this program started by mpirun/srun?)".to_string())?;
        *crate::sync::lock(&UNIVERSE) = Some(universe);
        // SAFETY: registering a plain extern "C" function; it runs once at process exit.
        unsafe { libc::atexit(finalize_at_exit) };
        provided
    };
    let library = mpi::environment::library_version().unwrap_or_default();
    let library = library.lines().next().unwrap_or("").trim().to_string();
    let in_place = in_place_sentinel(&library);
    let thread_multiple = provided == mpi::Threading::Multiple;
    if !thread_multiple {
        tracing::info!("MPI grants {provided:?} threading only: MPI calls are serialised process-wide");
    }
    Ok(MpiRuntime { thread_multiple, library, in_place, lock: Mutex::new(()) })
}

/// `MPI_IN_PLACE` is `(void*)1` in Open MPI's mpi.h and `(void*)-1` in MPICH's (and its derivatives: Intel MPI,
/// MVAPICH). mpi-sys does not export it, so it is chosen from the library's name; unknown libraries get `None`
/// and in-place all_reduce copies the input instead.
fn in_place_sentinel(library: &str) -> Option<usize> {
    if library.contains("Open MPI") {
        Some(1)
    } else if library.contains("MPICH") || library.contains("Intel(R) MPI") || library.contains("MVAPICH") {
        Some(usize::MAX)
    } else {
        None
    }
}

extern "C" fn finalize_at_exit() {
    // Dropping rsmpi's Universe calls MPI_Finalize. A panic must not unwind into C.
    let _ = std::panic::catch_unwind(|| {
        let universe = crate::sync::lock(&UNIVERSE).take();
        drop(universe);
    });
}

/// This machine's name as MPI reports it (`MPI_Get_processor_name`).
pub fn processor_name() -> String {
    mpi::environment::processor_name().unwrap_or_else(|_| "unknown-host".into())
}

/// `MPI_Error_string` of an error code.
pub fn error_string(code: i32) -> String {
    let mut buf = [0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters as the standard requires.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return format!("MPI error code {code}");
    }
    let bytes: Vec<u8> = buf[..len.max(0) as usize].iter().map(|&c| c as u8).collect();
    format!("{} (MPI error code {code})", String::from_utf8_lossy(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_sentinels_follow_the_library_family() {
        assert_eq!(in_place_sentinel("Open MPI v4.1.4, package: Debian OpenMPI"), Some(1));
        assert_eq!(in_place_sentinel("MPICH Version: 4.0"), Some(usize::MAX));
        assert_eq!(in_place_sentinel("Some Other MPI"), None);
    }
}
