//! TEMPORARY stand-ins until accel's state module lands (removed then).
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
pub(crate) trait CheckpointShim {
    fn register_for_checkpointing(&self, obj: Arc<Mutex<dyn accel::state::Stateful + Send>>);
    fn save_state(&self, dir: Option<&Path>) -> accel::Result<PathBuf>;
    fn load_state(&self, dir: Option<&Path>) -> accel::Result<PathBuf>;
}
impl CheckpointShim for accel::Accelerator {
    fn register_for_checkpointing(&self, _obj: Arc<Mutex<dyn accel::state::Stateful + Send>>) {}
    fn save_state(&self, dir: Option<&Path>) -> accel::Result<PathBuf> {
        let d = dir.unwrap().to_path_buf();
        std::fs::create_dir_all(&d).unwrap();
        if self.is_main_process() {
            let m = self.prepared_models()[0].state_dict();
            accel::state::save_safetensors(&m, &d.join("model.safetensors"))?;
        }
        Ok(d)
    }
    fn load_state(&self, _dir: Option<&Path>) -> accel::Result<PathBuf> {
        Err(accel::AccelError::Usage("load_state not available yet".into()))
    }
}
