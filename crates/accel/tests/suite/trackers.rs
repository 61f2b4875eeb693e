//! Trackers: JSONL lines and the tracker names; TensorBoard event files are checked in `tensorboard.rs`.

use accel::tracking::{JsonlTracker, Tracker, TrackerKind};

#[test]
fn jsonl_writes_one_object_per_log_call() {
    let dir = tempfile::tempdir().unwrap();
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let mut t = JsonlTracker::new(&dir.path().join("run")).unwrap();
    t.log(&[("loss", 0.75), ("lr", 1e-3)], 1).unwrap();
    t.log(&[("loss", 0.5)], 2).unwrap();
    t.log(&[("loss", f64::NAN), ("grad_norm", f64::INFINITY)], 3).unwrap();
    t.finish().unwrap();
    assert!(t.log(&[("loss", 1.0)], 4).is_err(), "logging after finish is an error");

    let text = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["step"], 1);
    assert_eq!(lines[0]["values"]["loss"], 0.75);
    assert_eq!(lines[0]["values"]["lr"], 1e-3);
    assert_eq!(lines[1]["values"], serde_json::json!({"loss": 0.5}));
    assert_eq!(lines[2]["values"]["loss"], "NaN");
    assert_eq!(lines[2]["values"]["grad_norm"], "Infinity");
    let wall = lines[0]["wall_time"].as_f64().unwrap();
    assert!(wall >= before.floor() && wall < before + 3600.0, "{wall}");

    // A second tracker on the same directory appends (resumed runs continue the file).
    let mut t = JsonlTracker::new(&dir.path().join("run")).unwrap();
    t.log(&[("loss", 0.25)], 4).unwrap();
    drop(t);
    let text = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 4);
}

#[test]
fn tracker_kinds_parse() {
    assert_eq!("jsonl".parse::<TrackerKind>().unwrap(), TrackerKind::Jsonl);
    assert_eq!("TensorBoard".parse::<TrackerKind>().unwrap(), TrackerKind::TensorBoard);
    let e = "wandb".parse::<TrackerKind>().unwrap_err().to_string();
    assert!(e.contains("wandb") && e.contains("tensorboard"), "{e}");
}

#[cfg(not(feature = "tensorboard"))]
#[test]
fn tensorboard_without_the_feature_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let e = TrackerKind::TensorBoard.create(dir.path()).err().expect("no TensorBoard writer in this build").to_string();
    assert_eq!(e, "built without feature `tensorboard` of crate accel: enable it in Cargo.toml");
    assert_eq!(TrackerKind::ALL, [TrackerKind::Jsonl]);
}
