//! With feature `nccl` on a machine without the CUDA driver or libnccl (this one, CI): asking for NCCL is a
//! clean [`DdpError::BackendUnavailable`] naming the library looked for and the fix — never a panic — and
//! `BackendKind::Auto` falls back to the CPU backend.
#![cfg(feature = "nccl")]

use ddp_core::{BackendKind, DdpError, InitOptions, ProcessGroup, ReduceOp};
use std::process::Command;

/// True when this machine really has a GPU and NCCL (then these tests have nothing to check).
fn gpu_present() -> bool {
    ddp_core::nccl::probe().is_ok()
}

#[test]
fn nccl_backend_without_libraries_is_a_clean_error() {
    if gpu_present() {
        eprintln!("a GPU and libnccl are present: nothing to check here");
        return;
    }
    let err = ddp_core::nccl::probe().unwrap_err();
    let DdpError::BackendUnavailable { backend, reason } = &err else { panic!("unexpected error {err}") };
    assert_eq!(*backend, "nccl");
    assert!(reason.contains("libcuda") || reason.contains("libnccl"), "{reason}");
    assert!(reason.contains("cpu"), "the message offers the CPU backend: {reason}");

    let mut opts = InitOptions::single_process();
    opts.backend = BackendKind::Nccl;
    let err = ProcessGroup::init(opts).unwrap_err();
    assert!(matches!(err, DdpError::BackendUnavailable { backend: "nccl", .. }), "{err}");
    assert!(err.to_string().starts_with("backend nccl unavailable:"), "{err}");
}

#[test]
fn auto_falls_back_to_the_cpu_backend() {
    if gpu_present() {
        return;
    }
    let mut opts = InitOptions::single_process();
    opts.backend = BackendKind::Auto;
    let pg = ProcessGroup::init(opts).expect("auto backend");
    assert_eq!(pg.backend_name(), "cpu");
    assert!(pg.nccl().is_none());
    let mut v = [2.0f32, 3.0];
    pg.all_reduce(&mut v, ReduceOp::Avg).unwrap();
    assert_eq!(v, [2.0, 3.0]);
}

/// With a driver library present but no libnccl, the error names libnccl, the file names cudarc tries, and
/// the `libnccl.so` link fix. The loader reads LD_LIBRARY_PATH at start-up, so this re-runs the test binary
/// with a stand-in `libcuda.so` (an empty shared object: the probe only opens it, never calls it).
#[test]
fn missing_libnccl_names_the_library_and_the_link_fix() {
    const CHILD: &str = "DDP_NCCL_FAKE_DRIVER_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let err = ddp_core::nccl::probe().unwrap_err().to_string();
        assert!(err.contains("libnccl was not found"), "{err}");
        assert!(err.contains("libnccl.so") && err.contains("LD_LIBRARY_PATH"), "{err}");
        assert!(err.contains("nvidia-nccl-cu12") && err.contains("libnccl2"), "{err}");
        return;
    }
    if gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("empty.c");
    std::fs::write(&src, "int ddp_core_fake_driver;\n").unwrap();
    let lib = dir.path().join("libcuda.so");
    let built = Command::new("cc").arg("-shared").arg("-fPIC").arg("-o").arg(&lib).arg(&src).status();
    if !matches!(built, Ok(s) if s.success()) {
        eprintln!("no C compiler to build a stand-in libcuda.so: skipped");
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "nccl_unavailable::missing_libnccl_names_the_library_and_the_link_fix",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", dir.path())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "child run failed:\n{text}");
}
