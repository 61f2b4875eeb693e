//! TensorBoard event files checked byte by byte with an independent reader (TFRecord framing with masked CRC32C,
//! hand-decoded `Event` protobuf), alone and through the Accelerator's trackers. Needs the feature `tensorboard`.
#![cfg(feature = "tensorboard")]

use accel::tracking::{TensorBoardTracker, Tracker, TrackerKind};
use accel::{Accelerator, AcceleratorConfig};
use std::path::{Path, PathBuf};

/// TensorFlow's masked CRC32C, written out here independently of the library.
#[allow(clippy::manual_rotate)] // spelled as in TensorFlow's crc32c.h on purpose
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8)
}

/// Splits a TFRecord file into its records, checking both CRCs of each.
fn read_records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut records = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        assert!(bytes.len() - pos >= 12, "truncated header at byte {pos}");
        let len_bytes = &bytes[pos..pos + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc(len_bytes), "length CRC of record {}", records.len());
        let data = &bytes[pos + 12..pos + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked_crc(data), "data CRC of record {}", records.len());
        records.push(data.to_vec());
        pos += 16 + len;
    }
    records
}

/// A protobuf field as decoded by [`fields`].
#[derive(Debug)]
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

fn varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = buf[*pos];
        *pos += 1;
        v |= ((b & 0x7f) as u64) << shift;
        if b & 0x80 == 0 {
            return v;
        }
    }
    panic!("varint too long")
}

/// Decodes the (field number, value) pairs of one protobuf message (wire types 0, 1, 2, 5).
fn fields(buf: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let key = varint(buf, &mut pos);
        let (num, wire) = (key >> 3, key & 7);
        let f = match wire {
            0 => Field::Varint(varint(buf, &mut pos)),
            1 => {
                pos += 8;
                Field::Fixed64(buf[pos - 8..pos].try_into().unwrap())
            }
            2 => {
                let len = varint(buf, &mut pos) as usize;
                pos += len;
                Field::Bytes(&buf[pos - len..pos])
            }
            5 => {
                pos += 4;
                Field::Fixed32(buf[pos - 4..pos].try_into().unwrap())
            }
            w => panic!("unexpected wire type {w}"),
        };
        out.push((num, f));
    }
    out
}

/// An `Event` as read back: wall_time (1), step (2), file_version (3), summary (5) → value (1) → tag (1),
/// simple_value (2).
#[derive(Debug, Default)]
struct DecodedEvent {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    scalars: Vec<(String, f32)>,
}

fn decode_event(buf: &[u8]) -> DecodedEvent {
    let mut e = DecodedEvent::default();
    for (num, f) in fields(buf) {
        match (num, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v as i64,
            (3, Field::Bytes(b)) => e.file_version = Some(String::from_utf8(b.to_vec()).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (vnum, vf) in fields(summary) {
                    let (1, Field::Bytes(value)) = (vnum, vf) else { panic!("Summary field {vnum}") };
                    let (mut tag, mut simple) = (String::new(), None);
                    for (n, f) in fields(value) {
                        match (n, f) {
                            (1, Field::Bytes(b)) => tag = String::from_utf8(b.to_vec()).unwrap(),
                            (2, Field::Fixed32(b)) => simple = Some(f32::from_le_bytes(b)),
                            (n, f) => panic!("unexpected Summary.Value field {n}: {f:?}"),
                        }
                    }
                    e.scalars.push((tag, simple.expect("simple_value present")));
                }
            }
            (n, f) => panic!("unexpected Event field {n}: {f:?}"),
        }
    }
    e
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."))
        .collect();
    v.sort();
    v
}

#[test]
fn tensorboard_event_files_have_valid_framing_crcs_and_events() {
    let dir = tempfile::tempdir().unwrap();
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let mut t = TensorBoardTracker::new(dir.path()).unwrap();
    let name = t.path().file_name().unwrap().to_string_lossy().to_string();
    t.log(&[("train/loss", 0.5), ("lr", 0.001)], 10).unwrap();
    t.log(&[("train/loss", 0.25), ("lr", 0.0)], 20).unwrap(); // a zero must still be written
    t.log(&[("train/loss", f64::NAN)], 30).unwrap();
    t.finish().unwrap();

    // events.out.tfevents.{secs}.{host}
    let parts: Vec<&str> = name.splitn(5, '.').collect();
    assert_eq!(&parts[..3], ["events", "out", "tfevents"], "{name}");
    let secs: u64 = parts[3].parse().unwrap();
    assert!(secs as f64 >= before.floor() - 1.0, "{name}");
    assert!(!parts[4].is_empty(), "host name in {name}");

    let files = event_files(dir.path());
    assert_eq!(files.len(), 1);
    let records = read_records(&std::fs::read(&files[0]).unwrap());
    assert_eq!(records.len(), 4);
    let events: Vec<DecodedEvent> = records.iter().map(|r| decode_event(r)).collect();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].wall_time >= before.floor() - 1.0);
    assert_eq!(events[1].step, 10);
    assert_eq!(events[1].scalars, [("train/loss".to_string(), 0.5f32), ("lr".to_string(), 0.001f32)]);
    assert!(events[1].wall_time >= events[0].wall_time);
    assert_eq!(events[2].step, 20);
    assert_eq!(events[2].scalars, [("train/loss".to_string(), 0.25f32), ("lr".to_string(), 0.0f32)]);
    assert!(events[3].scalars[0].1.is_nan());
}

#[test]
fn two_event_files_in_one_second_get_distinct_names() {
    let dir = tempfile::tempdir().unwrap();
    let a = TensorBoardTracker::new(dir.path()).unwrap();
    let b = TensorBoardTracker::new(dir.path()).unwrap();
    assert_ne!(a.path(), b.path());
    drop((a, b));
    for f in event_files(dir.path()) {
        assert_eq!(read_records(&std::fs::read(f).unwrap()).len(), 1);
    }
}

#[test]
fn accelerator_trackers_write_under_logging_dir_and_project() {
    let dir = tempfile::tempdir().unwrap();
    let pg = ddp_core::ProcessGroup::single_process().unwrap();
    let acc = Accelerator::with_process_group(AcceleratorConfig::default(), pg).unwrap();
    acc.log(&[("ignored", 1.0)], 0).unwrap(); // before init_trackers: a no-op
    acc.init_trackers("mnist", &[TrackerKind::Jsonl, TrackerKind::TensorBoard], dir.path()).unwrap();
    assert_eq!(acc.tracker_dir().unwrap(), dir.path().join("mnist"));
    acc.log(&[("loss", 2.0)], 1).unwrap();
    acc.log(&[("loss", 1.0), ("accuracy", 0.5)], 2).unwrap();
    acc.end_training().unwrap();
    acc.end_training().unwrap(); // idempotent
    acc.log(&[("after", 1.0)], 3).unwrap(); // after end_training: a no-op

    let text = std::fs::read_to_string(dir.path().join("mnist/metrics.jsonl")).unwrap();
    let steps: Vec<u64> =
        text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2]);
    let files = event_files(&dir.path().join("mnist"));
    assert_eq!(files.len(), 1);
    let events: Vec<DecodedEvent> =
        read_records(&std::fs::read(&files[0]).unwrap()).iter().map(|r| decode_event(r)).collect();
    assert_eq!(events.len(), 3);
    assert_eq!(events[2].scalars, [("loss".to_string(), 1.0f32), ("accuracy".to_string(), 0.5f32)]);

    let e = acc.init_trackers("../escape", &[TrackerKind::Jsonl], dir.path()).unwrap_err().to_string();
    assert!(e.contains("project name"), "{e}");
}

#[test]
fn only_the_main_process_writes() {
    use ddp_core::store::MemoryStore;
    use ddp_core::{GroupOptions, ProcessGroup, Store};
    use std::sync::Arc;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(120)));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (store, logging_dir) = (store.clone(), dir.path().to_path_buf());
            std::thread::spawn(move || {
                let opts = GroupOptions { timeout: Duration::from_secs(120), ..Default::default() };
                let pg = ProcessGroup::from_store(store, rank, 2, opts).unwrap();
                let acc = Accelerator::with_process_group(AcceleratorConfig::default(), pg).unwrap();
                acc.init_trackers("run", &TrackerKind::ALL, &logging_dir).unwrap();
                for step in 1..=3u64 {
                    acc.log(&[("loss", 1.0 / step as f64), ("rank", rank as f64)], step).unwrap();
                }
                let dir = acc.tracker_dir();
                acc.wait_for_everyone().unwrap();
                acc.end_training().unwrap();
                dir
            })
        })
        .collect();
    let dirs: Vec<Option<PathBuf>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(dirs, [Some(dir.path().join("run")), None]);
    let text = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines.iter().all(|l| l["values"]["rank"] == 0.0), "{text}");
    assert_eq!(event_files(&dir.path().join("run")).len(), 1);
}
